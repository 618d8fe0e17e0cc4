#include "engine/parallel/comm_socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "base/error.h"

namespace llmq {

namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'L', 'L', 'M', 'Q', 'T', 'P', '0', '2'};
constexpr uint64_t kMaxCommand = uint64_t(1) << 30;  // larger than any command (a batch and its block tables)

struct Endpoint {
  std::string host, port;
};

Endpoint split_host_port(const std::string& s, const std::string& init) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size())
    throw UsageError("--tp-init '" + init + "': expected tcp://HOST:PORT or file://PATH");
  Endpoint e{s.substr(0, colon), s.substr(colon + 1)};
  for (char ch : e.port)
    if (ch < '0' || ch > '9' || e.port.size() > 5) throw UsageError("--tp-init '" + init + "': the port must be a number from 1 to 65535");
  if (std::stoi(e.port) < 1 || std::stoi(e.port) > 65535) throw UsageError("--tp-init '" + init + "': the port must be a number from 1 to 65535");
  return e;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Socket timeouts for the handshake (a silent peer cannot hold a rank forever); 0 clears them.
void set_timeout(int fd, std::chrono::milliseconds ms) {
  timeval tv{};
  if (ms.count() > 0) tv.tv_sec = ms.count() / 1000, tv.tv_usec = (ms.count() % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

std::chrono::milliseconds left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Handshake I/O: false on EOF, timeout or error (the caller names the fault).
bool write_exact(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k, n -= size_t(k);
  }
  return true;
}

bool read_exact(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k, n -= size_t(k);
  }
  return true;
}

bool write_string(int fd, const std::string& s) {
  const uint32_t n = uint32_t(s.size());
  return write_exact(fd, &n, 4) && write_exact(fd, s.data(), s.size());
}

bool read_string(int fd, std::string& s, uint32_t max) {
  uint32_t n = 0;
  if (!read_exact(fd, &n, 4) || n > max) return false;
  s.resize(n);
  return read_exact(fd, s.data(), n);
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // decode sends small messages, one per layer
  // A peer machine that loses power or its network sends no FIN: keepalive probes find it gone
  // (after 30 s idle, 3 probes 10 s apart) and the blocked receive fails instead of waiting forever.
  int idle = 30, interval = 10, count = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

// A connection to a loopback port nobody listens on can connect to itself (TCP simultaneous
// open, when the port is in the ephemeral range): not rank 0.
bool self_connected(int fd) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof a, lb = sizeof b;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0 || getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  return la == lb && std::memcmp(&a, &b, la) == 0;
}

// A fresh secret for a file:// rendezvous: 128 random bits, hex.
std::string make_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", unsigned(rd()));
    t += buf;
  }
  return t;
}

int listen_on(const std::string& host, const std::string& port, const std::string& init) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM, hints.ai_flags = AI_PASSIVE;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) throw UsageError("--tp-init '" + init + "': cannot resolve '" + host + "': " + gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    why = std::strerror(errno);
    close_fd(fd);
  }
  freeaddrinfo(res);
  throw UsageError("--tp-init '" + init + "': rank 0 cannot listen on " + host + ":" + port + ": " + why);
}

// One attempt to connect to host:port: the socket, or -1 with the reason in `why`.
int connect_once(const Endpoint& e, std::string& why) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM;
  const int rc = getaddrinfo(e.host.c_str(), e.port.c_str(), &hints, &res);
  if (rc != 0) {
    why = gai_strerror(rc);
    return -1;
  }
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      if (self_connected(fd)) {
        why = "nobody listens there";
        close_fd(fd);
        continue;
      }
      freeaddrinfo(res);
      return fd;
    }
    why = std::strerror(errno);
    close_fd(fd);
  }
  freeaddrinfo(res);
  return -1;
}

// file://PATH: the address and the secret rank 0 published ("HOST:PORT TOKEN"), or nothing yet.
bool read_published(const std::string& path, Endpoint& e, std::string& token, const std::string& init) {
  std::ifstream f(path);
  std::string addr;
  if (!f || !(f >> addr >> token) || addr.empty()) return false;
  e = split_host_port(addr, init);
  return true;
}

// Connects to rank 0, retrying every 100 ms while it is not listening (or, file://, has not
// published its address, or an older run's address is still there) until the deadline.
int connect_to_rank0(bool tcp, const std::string& rest, Clock::time_point deadline, const std::string& init, std::string& token,
                     const std::atomic<bool>* cancel) {
  std::string why = "timed out";
  Endpoint e;
  bool published = false;
  do {
    if (cancel && *cancel) throw UsageError("--tp-init '" + init + "': cancelled while waiting for rank 0");
    if (tcp) e = split_host_port(rest, init), published = true;
    else if (read_published(rest, e, token, init)) published = true;  // read again each time: rank 0 may rewrite it
    if (published) {
      const int fd = connect_once(e, why);
      if (fd >= 0) return fd;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (Clock::now() < deadline);
  if (!published) throw UsageError("--tp-init '" + init + "': rank 0 did not publish its address in " + rest);
  throw UsageError("--tp-init '" + init + "': cannot reach rank 0 at " + e.host + ":" + e.port + ": " + why);
}

// Writes "host:port" to path atomically (temp file, fsync, rename).
void publish(const std::string& path, const std::string& text, const std::string& init) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);  // the secret: the owner's only
  FILE* f = fd >= 0 ? ::fdopen(fd, "wb") : nullptr;
  if (fd >= 0 && !f) ::close(fd);
  bool ok = f && std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  if (f) ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw UsageError("--tp-init '" + init + "': cannot write " + path + ": " + why);
  }
}

// A rank other than 0, connected: its hello (magic, --tp, rank, secret, model signature), then
// rank 0's verdict. Throws UsageError (closing fd) when rank 0 does not answer or refuses.
void say_hello(int& fd, int size, int rank, const std::string& token, const std::string& signature, const std::string& init) {
  const uint32_t hdr[2] = {uint32_t(size), uint32_t(rank)};
  std::string verdict;
  uint32_t ok = 0;
  if (!write_exact(fd, kMagic, 8) || !write_exact(fd, hdr, 8) || !write_string(fd, token) || !write_string(fd, signature) ||
      !read_exact(fd, &ok, 4) || !read_string(fd, verdict, 4096)) {
    close_fd(fd);
    throw UsageError("--tp-init '" + init + "': rank 0 did not answer rank " + std::to_string(rank) + "'s hello");
  }
  if (!ok) {
    close_fd(fd);
    throw UsageError("tensor parallel: rank 0 refused rank " + std::to_string(rank) + ": " + verdict);
  }
  set_timeout(fd, std::chrono::milliseconds(0));
  tune(fd);
}

// file://: rank 0's listening address and a fresh secret, written to the rendezvous file
// (publish: mode 0600, atomically). Returns the secret.
std::string publish_rendezvous(int lfd, const std::string& path, const std::string& init) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  const std::string token = make_token();
  publish(path, std::string(host) + ":" + std::to_string(port) + " " + token + "\n", init);
  return token;
}

}  // namespace

SocketComm::SocketComm(int rank, int size, std::vector<int> fds) : rank_(rank), size_(size), fds_(std::move(fds)) {}

SocketComm::~SocketComm() {
  for (int& fd : fds_) close_fd(fd);
}

std::unique_ptr<SocketComm> SocketComm::join(const std::string& init, int rank, int size, const std::string& signature,
                                             std::chrono::milliseconds timeout, const std::atomic<bool>* cancel) {
  if (size < 2) throw UsageError("--tp-init: a group of processes needs --tp 2 or more");
  if (rank < 0 || rank >= size)
    throw UsageError("--tp-rank " + std::to_string(rank) + " is not a rank of --tp " + std::to_string(size) + " (0 .. " +
                     std::to_string(size - 1) + ")");
  const bool tcp = init.rfind("tcp://", 0) == 0, file = init.rfind("file://", 0) == 0;
  if (!tcp && !file) throw UsageError("--tp-init '" + init + "': expected tcp://HOST:PORT or file://PATH");
  const std::string rest = init.substr(tcp ? 6 : 7);
  if (rest.empty()) throw UsageError("--tp-init '" + init + "': expected tcp://HOST:PORT or file://PATH");
  if (tcp) split_host_port(rest, init);  // a malformed address fails at once
  const Clock::time_point deadline = Clock::now() + timeout;
  char secs_buf[32];
  std::snprintf(secs_buf, sizeof secs_buf, "%.1f s", double(timeout.count()) / 1000.0);
  const std::string secs = secs_buf;
  // The secret a rank must show: file://, the one rank 0 wrote beside its address; tcp://,
  // LLMQ_TP_TOKEN if set (the same on every rank), else none (a private network is assumed).
  std::string token;
  if (tcp)
    if (const char* t = std::getenv("LLMQ_TP_TOKEN")) token = t;
  // A hello and its answer are small: a peer gets this long for each, at most.
  auto hello_time = [&] { return std::min<std::chrono::milliseconds>(std::max(left(deadline), std::chrono::milliseconds(2000)), std::chrono::seconds(10)); };

  if (rank != 0) {
    int fd = connect_to_rank0(tcp, rest, deadline, init, token, cancel);
    set_timeout(fd, hello_time());
    say_hello(fd, size, rank, token, signature, init);
    return std::unique_ptr<SocketComm>(new SocketComm(rank, size, {fd}));
  }

  // Rank 0: listen, publish (file://: address and a fresh secret), accept ranks 1 .. size-1
  // once each. A connection that is not a rank of this job (no hello, another protocol, a wrong
  // secret) is dropped and the others still wait; a rank of this job whose --tp, rank or
  // signature does not fit fails the group (the ranks were started wrongly).
  const Endpoint e = tcp ? split_host_port(rest, init) : Endpoint{"", "0"};
  int lfd = listen_on(e.host, e.port, init);
  std::vector<int> fds(size_t(size), -1);
  auto cleanup = [&] {
    close_fd(lfd);
    if (file) std::remove(rest.c_str());  // the rendezvous is over: a later run must not find this address
  };
  auto fail = [&](const std::string& msg) -> std::unique_ptr<SocketComm> {
    cleanup();
    for (int& fd : fds) close_fd(fd);
    throw UsageError(msg);
  };
  if (file) {
    try {
      token = publish_rendezvous(lfd, rest, init);
    } catch (const UsageError&) {
      close_fd(lfd);
      throw;
    }
  }
  int dropped = 0;
  for (int joined = 1; joined < size;) {
    if (cancel && *cancel) return fail("--tp-init '" + init + "': cancelled while waiting for the other ranks");
    pollfd p{lfd, POLLIN, 0};
    const int rc = ::poll(&p, 1, int(std::min<int64_t>(left(deadline).count(), 100)));  // 0.1 s slices: cancel is seen
    if ((rc < 0 && errno == EINTR) || (rc == 0 && Clock::now() < deadline)) continue;
    if (rc <= 0)
      return fail("--tp-init '" + init + "': " + std::to_string(joined - 1) + " of " + std::to_string(size - 1) +
                  " other ranks joined within " + secs + (dropped ? " (" + std::to_string(dropped) + " other connections dropped)" : ""));
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_timeout(fd, hello_time());
    char magic[8];
    uint32_t hdr[2];
    std::string tok, sig;
    if (!read_exact(fd, magic, 8) || std::memcmp(magic, kMagic, 8) != 0 || !read_exact(fd, hdr, 8) || !read_string(fd, tok, 256) ||
        !read_string(fd, sig, 1 << 16)) {
      close_fd(fd);  // not one of ours (a port scan, another program, a silent peer)
      ++dropped;
      continue;
    }
    const uint32_t refused = 0;
    if (tok != token) {  // someone else's job, or a stranger: told, dropped, the group still waits
      write_exact(fd, &refused, 4);
      write_string(fd, "wrong secret (file://: the one in the rendezvous file; tcp://: LLMQ_TP_TOKEN)");
      close_fd(fd);
      ++dropped;
      continue;
    }
    const int r = int(hdr[1]);
    std::string why;
    if (int(hdr[0]) != size) why = "it was started with --tp " + std::to_string(hdr[0]) + ", rank 0 with --tp " + std::to_string(size);
    else if (r <= 0 || r >= size) why = "rank " + std::to_string(r) + " is not a rank of --tp " + std::to_string(size);
    else if (fds[size_t(r)] >= 0) why = "rank " + std::to_string(r) + " joined twice";
    else if (sig != signature) why = "its model or options differ (rank " + std::to_string(r) + ": " + sig + "; rank 0: " + signature + ")";
    const uint32_t ok = why.empty();
    write_exact(fd, &ok, 4);
    write_string(fd, why);
    if (!ok) {
      close_fd(fd);
      return fail("tensor parallel: rank 0 refused a rank: " + why);
    }
    set_timeout(fd, std::chrono::milliseconds(0));
    tune(fd);
    fds[size_t(r)] = fd;
    ++joined;
  }
  cleanup();
  return std::unique_ptr<SocketComm>(new SocketComm(0, size, std::move(fds)));
}

bool SocketComm::peers_alive() const {
  std::vector<pollfd> ps;
  for (int fd : fds_)
    if (fd >= 0) ps.push_back({fd, POLLRDHUP, 0});
  if (::poll(ps.data(), ps.size(), 0) < 0) return true;  // cannot tell
  for (const pollfd& p : ps)
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return false;
  return !aborted_;
}

std::string SocketComm::gone(int peer) const {
  return "tensor parallel: rank " + std::to_string(peer) + " is gone (its connection to rank " + std::to_string(rank_) +
         " closed: the process ended or failed)";
}

void SocketComm::send_all(int peer, const void* p, uint64_t n) {
  if (aborted_) throw CommAborted("tensor parallel: the group was aborted");
  const int fd = fd_of(peer);
  if (!write_exact(fd, &n, 8) || !write_exact(fd, p, size_t(n))) throw CommAborted(gone(peer));
}

void SocketComm::recv_all(int peer, void* p, uint64_t n) {
  if (aborted_) throw CommAborted("tensor parallel: the group was aborted");
  const int fd = fd_of(peer);
  uint64_t got = 0;
  if (!read_exact(fd, &got, 8)) throw CommAborted(gone(peer));
  if (got != n) {
    abort();
    throw CommAborted("tensor parallel: ranks out of step (a message of " + std::to_string(got) + " bytes where " + std::to_string(n) +
                      " were expected)");
  }
  if (!read_exact(fd, p, size_t(n))) throw CommAborted(gone(peer));
}

void SocketComm::all_reduce_sum(float* buf, int64_t n) {
  if (n <= 0) return;
  const uint64_t bytes = uint64_t(n) * sizeof(float);
  if (rank_ != 0) {
    send_all(0, buf, bytes);
    recv_all(0, buf, bytes);
    return;
  }
  scratch_.resize(size_t(n));
  for (int r = 1; r < size_; ++r) {  // ((b0 + b1) + b2) + ...: HostComm's order
    recv_all(r, scratch_.data(), bytes);
    for (int64_t i = 0; i < n; ++i) buf[i] += scratch_[size_t(i)];
  }
  for (int r = 1; r < size_; ++r) send_all(r, buf, bytes);
}

void SocketComm::gather(const float* send, int64_t count, float* recv, int64_t capacity, int root) {
  if (root != 0) throw UsageError("SocketComm::gather: only rank 0 gathers");
  if (rank_ != 0) {
    const int64_t c = count;
    send_all(0, &c, sizeof c);
    if (c > 0) send_all(0, send, uint64_t(c) * sizeof(float));
    return;
  }
  int64_t room = capacity;
  auto take = [&](int64_t c) {  // a count that does not fit ends the group before anything is written
    if (c < 0 || c > room) {
      abort();
      throw CommAborted("tensor parallel: a gather of " + std::to_string(c) + " values into room for " + std::to_string(std::max<int64_t>(room, 0)) +
                        " (ranks out of step, or a corrupt peer)");
    }
    room -= c;
  };
  take(count);
  std::copy(send, send + count, recv);
  recv += count;
  for (int r = 1; r < size_; ++r) {
    int64_t c = 0;
    recv_all(r, &c, sizeof c);
    take(c);
    if (c > 0) recv_all(r, recv, uint64_t(c) * sizeof(float));
    recv += c;
  }
}

void SocketComm::barrier() {
  char b = 0;
  if (rank_ != 0) {
    send_all(0, &b, 1);
    recv_all(0, &b, 1);
    return;
  }
  for (int r = 1; r < size_; ++r) recv_all(r, &b, 1);
  for (int r = 1; r < size_; ++r) send_all(r, &b, 1);
}

void SocketComm::abort() {
  aborted_ = true;
  for (int fd : fds_)
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);  // peers' receives see the end of the stream
}

void SocketComm::broadcast(const void* bytes, uint64_t n) {
  if (rank_ != 0) throw UsageError("SocketComm::broadcast: only rank 0 broadcasts");
  for (int r = 1; r < size_; ++r) send_all(r, bytes, n);
}

std::vector<uint8_t> SocketComm::recv_broadcast() {
  if (rank_ == 0) throw UsageError("SocketComm::recv_broadcast: rank 0 broadcasts");
  if (aborted_) throw CommAborted("tensor parallel: the group was aborted");
  uint64_t n = 0;
  if (!read_exact(fd_of(0), &n, 8)) throw CommAborted(gone(0));
  if (n > kMaxCommand) {
    abort();
    throw CommAborted("tensor parallel: ranks out of step (a command of " + std::to_string(n) + " bytes)");
  }
  std::vector<uint8_t> out(static_cast<size_t>(n));
  if (!read_exact(fd_of(0), out.data(), size_t(n))) throw CommAborted(gone(0));
  return out;
}

}  // namespace llmq
