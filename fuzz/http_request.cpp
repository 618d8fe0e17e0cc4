// Fuzz target http_request: llmq-server's connection handling (server/http_guard.h: the request
// deadline, header limits and keep-alive loop around cpp-httplib's request parsing) on arbitrary
// bytes from a client: request lines, header fields, Content-Length and chunked bodies,
// pipelined requests. The input is written into one end of a socketpair, whose sending side is
// then shut down; the server serves the other end. Routes as the real server's shape: a GET, a
// POST that reads its body, and a chunked response.
// Checked: no crash or sanitizer report, and every response the server writes starts with a
// status line.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <thread>

#include "fuzz/fuzz_common.h"
#include "server/http_guard.h"

using namespace llmq;

namespace {

GuardedServer& server() {
  static GuardedServer* s = [] {
    HttpLimits lim;
    lim.request_deadline_s = 2, lim.stall_s = 2, lim.keep_alive_s = 0.05, lim.max_requests_per_connection = 16;
    auto* svr = new GuardedServer(lim);
    svr->set_payload_max_length(1 << 16);
    svr->Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("{}", "application/json"); });
    svr->Post("/v1/completions", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content("{\"bytes\": " + std::to_string(req.body.size()) + "}", "application/json");
    });
    svr->Get("/stream", [](const httplib::Request&, httplib::Response& res) {
      res.set_chunked_content_provider("text/event-stream", [](size_t off, httplib::DataSink& sink) {
        if (off < 3) return sink.write("data: x\n\n", 9);
        sink.done();
        return true;
      });
    });
    return svr;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1u << 16)) return 0;  // the socket buffer takes it in one write
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 0;
  int buf = 1 << 18;
  ::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  if (::write(sv[0], data, size) != ssize_t(size)) fuzz::fail("short write into the socketpair");
  ::shutdown(sv[0], SHUT_WR);
  std::string out;
  std::thread reader([&] {
    char chunk[4096];
    ssize_t n;
    while ((n = ::read(sv[0], chunk, sizeof chunk)) > 0) out.append(chunk, size_t(n));
  });
  server().serve(sv[1], /*while_running=*/false);  // closes sv[1]
  reader.join();
  ::close(sv[0]);
  if (!out.empty() && out.rfind("HTTP/1.1 ", 0) != 0) fuzz::fail("a response without a status line");
  return 0;
}
