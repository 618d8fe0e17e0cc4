#include "server/http_guard.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace llmq {

namespace {

using Clock = std::chrono::steady_clock;

int to_ms(double seconds) { return seconds <= 0 ? 0 : int(std::min(seconds, 86400.0) * 1000.0); }

// Waits up to `ms` for `events` on sock; true when ready (readable includes end of stream).
bool wait_for(socket_t sock, short events, int ms) {
  pollfd p{sock, events, 0};
  int r;
  do r = ::poll(&p, 1, ms);
  while (r < 0 && errno == EINTR);
  return r > 0;
}

// The peer's (or, local = true, our) address and port.
void address_of(socket_t sock, bool local, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  ip.clear(), port = 0;
  if ((local ? ::getsockname(sock, reinterpret_cast<sockaddr*>(&a), &n) : ::getpeername(sock, reinterpret_cast<sockaddr*>(&a), &n)) != 0) return;
  char buf[INET6_ADDRSTRLEN] = "";
  if (a.ss_family == AF_INET) {
    const auto* s = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &s->sin_addr, buf, sizeof buf);
    port = ntohs(s->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* s = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &s->sin6_addr, buf, sizeof buf);
    port = ntohs(s->sin6_port);
  }
  ip = buf;
}

// One connection's byte stream for httplib's request processing: a read buffer that lives as
// long as the connection (pipelined requests stay in it), reads bounded by the request's
// deadline and by `stall_s` each, and the header's size and lines counted as httplib reads it.
class GuardedStream final : public httplib::Stream {
 public:
  GuardedStream(socket_t sock, const HttpLimits& lim) : sock_(sock), lim_(lim) {}

  // Waits up to `seconds` for the next request's first byte (already buffered, or on the
  // socket; the end of the stream counts, and httplib's read of it then ends the connection).
  // Starts that request's deadline and header count.
  bool next_request(double seconds) {
    if (pos_ == end_ && !wait_for(sock_, POLLIN, to_ms(seconds))) return false;
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(lim_.request_deadline_s));
    in_header_ = true, header_bytes_ = 0, lines_ = 0, tail_ = 0, http10_ = false;
    return true;
  }
  // The last request was cut: its deadline passed, a read stalled, or its header was too large.
  bool dropped() const { return dropped_; }

  bool is_readable() const override { return pos_ < end_ || wait_for(sock_, POLLIN, to_ms(std::min(left(), lim_.stall_s))); }
  // Writable while the socket takes bytes and the peer is there. A peer that ended its side of
  // the stream has gone (a client that hung up: its streams and queued requests are cancelled at
  // once), except after an HTTP/1.0 request, whose tools may shut down their sending side and
  // still read the response.
  bool is_writable() const override {
    if (!http10_ && peer_ended()) return false;
    return wait_for(sock_, POLLOUT, to_ms(lim_.stall_s));
  }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == end_ && !fill()) return -1;
    if (pos_ == end_) return 0;  // the peer ended the stream
    size_t n = std::min(size, end_ - pos_);
    if (in_header_) n = scan_header(n);
    if (n == 0) return -1;
    std::memcpy(ptr, buf_ + pos_, n);
    pos_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t r;
    do r = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    return r;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, false, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, true, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  // The peer sent its end of stream and nothing is left unread on the socket.
  bool peer_ended() const {
    char c;
    ssize_t r;
    do r = ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    return r == 0;
  }
  double left() const { return std::chrono::duration<double>(deadline_ - Clock::now()).count(); }

  // Refills the empty buffer; false at the deadline, after a stalled read or on an error
  // (end of stream: true with nothing in the buffer).
  bool fill() {
    pos_ = end_ = 0;
    const double wait = std::min(left(), lim_.stall_s);
    if (wait <= 0 || !wait_for(sock_, POLLIN, to_ms(wait))) {
      dropped_ = true;
      return false;
    }
    ssize_t r;
    do r = ::recv(sock_, buf_, sizeof buf_, 0);
    while (r < 0 && errno == EINTR);
    if (r < 0) return false;
    end_ = size_t(r);
    return true;
  }

  // Counts the header bytes among the next n buffered ones; returns how many of them may be
  // read (up to the header's end), 0 when the header is over a limit.
  size_t scan_header(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      const char c = buf_[pos_ + i];
      tail_ = (tail_ << 8) | uint8_t(c);
      if (++header_bytes_ > lim_.max_header_bytes || (c == '\n' && ++lines_ > lim_.max_header_lines + 2)) {
        dropped_ = true;
        return i;  // what is before the limit, then -1 on the next read
      }
      if (c == '\n' && lines_ == 1) {  // the request line ends "... HTTP/1.0\r\n"? (the tail holds its last 4 bytes)
        http10_ = version_tail_ == 0x312E300Du || version_tail_ == 0x2F312E30u;  // "1.0\r", or "/1.0" before a bare LF
      }
      if (lines_ == 0) version_tail_ = tail_;
      if ((tail_ & 0xFFFFFFFFu) == 0x0D0A0D0Au || (tail_ & 0xFFFFu) == 0x0A0Au) {  // CRLF CRLF (or LF LF): the body follows
        in_header_ = false;
        return i + 1;
      }
    }
    return n;
  }

  socket_t sock_;
  const HttpLimits& lim_;
  char buf_[4096];
  size_t pos_ = 0, end_ = 0;
  Clock::time_point deadline_ = Clock::now();
  bool in_header_ = false, dropped_ = false, http10_ = false;
  size_t header_bytes_ = 0, lines_ = 0;
  uint32_t tail_ = 0, version_tail_ = 0;
};

// Answers 503 before reading anything and lets the peer read it: our side is shut down first
// and what the peer sent is drained for a moment, so the close does not reset the connection
// under the response.
void refuse(socket_t sock) {
  const std::string body =
      R"({"error":{"message":"too many connections to this server; retry later","type":"server_error","param":null,"code":"too_many_connections"}})";
  const std::string msg = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" + body;
  (void)::send(sock, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(sock, SHUT_WR);
  char sink[1024];
  const auto until = Clock::now() + std::chrono::milliseconds(200);
  while (Clock::now() < until && wait_for(sock, POLLIN, 50))
    if (::recv(sock, sink, sizeof sink, MSG_DONTWAIT) <= 0) break;
}

}  // namespace

bool GuardedServer::admit(const std::string& ip) {
  std::lock_guard<std::mutex> lk(mu_);
  int& mine = per_ip_[ip];
  if (open_ >= limits_.max_connections || mine >= limits_.max_per_ip) {
    if (mine == 0) per_ip_.erase(ip);
    return false;
  }
  ++mine, ++open_;
  return true;
}

void GuardedServer::leave(const std::string& ip) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = per_ip_.find(ip);
  if (it != per_ip_.end() && --it->second <= 0) per_ip_.erase(it);
  --open_;
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  serve(sock);
  return true;
}

void GuardedServer::serve(socket_t sock, bool while_running) {
  std::string ip;
  int port = 0;
  address_of(sock, false, ip, port);
  if (!admit(ip)) {
    ++stats_.refused_connections;
    refuse(sock);
  } else {
    GuardedStream strm(sock, limits_);
    for (size_t k = limits_.max_requests_per_connection; k > 0 && (is_running() || !while_running); --k) {
      if (!strm.next_request(limits_.keep_alive_s)) break;
      bool closed = false;
      const bool ok = process_request(strm, k == 1, closed, nullptr);
      if (strm.dropped()) {
        ++stats_.deadline_drops;
        break;
      }
      if (!ok || closed) break;
    }
    leave(ip);
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

}  // namespace llmq
