// llmq-server's connection handling (issue 22): cpp-httplib's request processing on a socket
// loop of our own, which adds what a reverse proxy would enforce in front of it:
// - a total deadline for a request's header and body (a slowloris client that sends one byte
//   at a time no longer resets a per-read timeout for ever);
// - limits on the header's bytes and lines, checked while it is read;
// - at most `max_connections` connections, and `max_per_ip` from one address: the others are
//   answered 503 at once instead of waiting for a worker;
// - one read buffer per connection, so a request pipelined behind another on a keep-alive
//   connection is kept (httplib 0.11 made a new buffered stream per request and dropped the
//   bytes it had read ahead);
// - a client that half-closes after its request (HTTP/1.0 tools) still gets its response: the
//   stream is writable while the socket takes bytes, whatever the read side says.
// Everything else (parsing, routing, handlers, chunked responses) is httplib's: the loop calls its
// Server::process_request, as its own loop does.
#pragma once
#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace llmq {

/// What one connection may take. Defaults are what the flags of llmq-server default to.
struct HttpLimits {
  double request_deadline_s = 15;  ///< seconds from a request's first byte until its header and body are in
  double stall_s = 30;             ///< seconds one read or write may wait for the peer (--timeout)
  double keep_alive_s = 5;         ///< seconds an idle keep-alive connection is kept
  size_t max_header_bytes = 16384; ///< request line and header fields, CRLFs included
  size_t max_header_lines = 100;   ///< header fields (the request line not counted)
  int max_connections = 256;       ///< open connections in all
  int max_per_ip = 64;             ///< open connections from one peer address
  size_t max_requests_per_connection = 100;  ///< keep-alive requests before the server closes
};

/// Counters of what the guard refused, for /metrics.
struct HttpGuardStats {
  std::atomic<uint64_t> refused_connections{0};  ///< over max_connections or max_per_ip (503)
  std::atomic<uint64_t> deadline_drops{0};       ///< requests dropped at the deadline or a header limit
};

/// An httplib::Server whose connections run through the guard above. Configure routes and
/// handlers as on httplib::Server; `limits` must be set before listening.
class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(const HttpLimits& limits) : limits_(limits) {}
  const HttpGuardStats& guard_stats() const { return stats_; }
  /// Serves one accepted connection to its end and closes it (what the listener's workers do;
  /// public for the fuzz target fuzz/http_request.cpp, which serves one end of a socketpair
  /// without listening: then `while_running` false keeps the keep-alive loop going).
  void serve(socket_t sock, bool while_running = true);
  /// Open connections now.
  int connections() const { return open_; }

 private:
  bool process_and_close_socket(socket_t sock) override;
  bool admit(const std::string& ip);  // counts the connection in, or false when over a limit
  void leave(const std::string& ip);

  HttpLimits limits_;
  HttpGuardStats stats_;
  std::mutex mu_;
  std::map<std::string, int> per_ip_;
  std::atomic<int> open_{0};
};

}  // namespace llmq
