// Crash safety of the file writers (issue 8). llmq-convert (formats/llmq_file.cpp, LlmqWriter)
// is the only tool that writes files; it is killed with SIGKILL at ~20 random moments spread
// over a conversion's measured run time (fixed seed), with and without a previous complete
// output in place. After every kill the output path must hold nothing, the previous file
// (byte-identical), or the new complete file (byte-identical to an uninterrupted conversion),
// and whatever is there must load with every checksum verified. A kill leaves at most one
// `.NAME.tmp.XXXXXX` file beside the output; the next conversion to that output removes it.
// Disk full (RLIMIT_FSIZE) at several points: a clear error, exit 2, no output, no temporary
// file, and a previous file left as it was.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "base/error.h"
#include "formats/llmq_file.h"
#include "test_util.h"

using namespace llmq;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

std::string stories_bin() { return test::shared("models/stories260K/stories260K.bin"); }
std::string stories_tok() { return test::shared("models/stories260K/tok512.bin"); }
std::string smollm2_gguf() {
  return (fs::path(__FILE__).parent_path().parent_path() / "models" / "smollm2-135m-instruct-q4_1.gguf").string();
}

/// XXH64 of a whole file's bytes; 0 when it cannot be read.
uint64_t file_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return 0;
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    XXH64_update(st, buf.data(), size_t(in.gcount()));
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

/// Temporary files of writers to `out` (".NAME.tmp.*" beside it).
std::vector<std::string> temporaries(const std::string& out) {
  std::vector<std::string> found;
  std::string prefix(".");  // built by appends: GCC 12 warns falsely (-Wrestrict) on "." + str
  prefix.append(fs::path(out).filename().string()).append(".tmp.");
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) found.push_back(e.path().string());
  return found;
}

/// "" when `path` opens as a .llmq with every checksum verified, else the error.
std::string load_error(const std::string& path) {
  try {
    LlmqFile::open(path, /*verify=*/true);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

/// Starts argv (no shell) with stdin and stdout on /dev/null; stderr goes to *err_fd (a pipe
/// the caller reads and closes) when err_fd is given, else to /dev/null. `fsize_limit` > 0
/// caps the size of files it may write (RLIMIT_FSIZE; SIGXFSZ ignored, so a write past the
/// limit fails with EFBIG, as on a full disk).
pid_t spawn(const std::vector<std::string>& argv, int* err_fd = nullptr, rlim_t fsize_limit = 0) {
  std::vector<char*> args = llmq::test::exec_args(argv);
  int pfd[2] = {-1, -1};
  if (err_fd && pipe2(pfd, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    llmq::test::child_stdio(err_fd ? pfd[1] : -1);
    if (fsize_limit > 0) {
      signal(SIGXFSZ, SIG_IGN);
      const rlimit lim{fsize_limit, fsize_limit};
      setrlimit(RLIMIT_FSIZE, &lim);
    }
    execv(args[0], args.data());
    _exit(127);
  }
  if (err_fd) {
    close(pfd[1]);
    *err_fd = pfd[0];
  }
  return pid;
}

/// Everything until end of file on fd, which it closes.
std::string read_all(int fd) {
  std::string s;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    s.append(buf, size_t(n));
  }
  close(fd);
  return s;
}

/// Waits for pid; returns its exit code, or -signal when a signal ended it.
int reap(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

std::vector<std::string> convert_argv(const std::vector<std::string>& input, const std::string& out) {
  std::vector<std::string> a{test::bin("llmq-convert")};
  a.insert(a.end(), input.begin(), input.end());
  a.insert(a.end(), {"-o", out, "-f", "--no-progress"});
  return a;
}

/// Runs a conversion to the end; returns its wall time in seconds (REQUIREs exit 0).
double convert(const std::vector<std::string>& input, const std::string& out) {
  const auto t0 = Clock::now();
  const int rc = reap(spawn(convert_argv(input, out)));
  INFO("llmq-convert to " << out);
  REQUIRE(rc == 0);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Kills conversions of `input` to one output at `kills` delays spread over its measured run
/// time, alternately with no file at the output and with `previous` (another complete .llmq)
/// copied there, and checks what each kill left (see the top of the file).
void kill_series(const std::string& name, const std::vector<std::string>& input, const std::string& previous,
                 int kills, uint32_t seed) {
  const std::string dir = test::scratch("crash_" + name);
  const std::string ref = dir + "/reference.llmq", out = dir + "/model.llmq";
  convert(input, ref);  // also warms the page cache, so the timed run below is typical
  const uint64_t ref_hash = file_hash(ref), prev_hash = file_hash(previous);
  REQUIRE(load_error(ref).empty());
  REQUIRE(ref_hash != prev_hash);
  const double run_s = convert(input, out);  // the uninterrupted run time the kills spread over
  REQUIRE(file_hash(out) == ref_hash);       // conversions are deterministic

  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int mid_run = 0, left_nothing = 0, left_previous = 0, left_new = 0, left_temp = 0;
  for (int i = 0; i < kills; ++i) {
    const bool with_previous = i % 2 == 1;
    fs::remove(out);
    if (with_previous) fs::copy_file(previous, out);
    // Stratified over [0, 1.3 x run time): every part of the run gets a kill, a few land after it.
    const double delay = run_s * 1.3 * (i + unit(rng)) / kills;
    const pid_t pid = spawn(convert_argv(input, out));
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    int status = 0;
    const bool finished = waitpid(pid, &status, WNOHANG) == pid;
    if (!finished) {
      kill(pid, SIGKILL);
      reap(pid);
      ++mid_run;
    }
    INFO(name << ": kill " << i << " at " << delay * 1000 << " ms of ~" << run_s * 1000 << " ms"
              << (with_previous ? ", previous file in place" : ", no previous file")
              << (finished ? " (the conversion had finished)" : ""));
    const auto temps = temporaries(out);
    CHECK(temps.size() <= 1);  // at most the killed writer's own
    left_temp += int(!temps.empty());
    if (!fs::exists(out)) {
      CHECK_FALSE(with_previous);  // the previous file is replaced only by rename, never removed
      ++left_nothing;
      continue;
    }
    const uint64_t h = file_hash(out);
    const bool is_new = h == ref_hash, is_previous = with_previous && h == prev_hash;
    CHECK((is_new || is_previous));
    CHECK(load_error(out) == "");
    left_new += int(is_new);
    left_previous += int(is_previous);
  }
  WARN(name << ": " << kills << " SIGKILLs over a " << int(run_s * 1000) << " ms conversion, " << mid_run
            << " mid-run: left no file " << left_nothing << "x, the previous file " << left_previous
            << "x, the new complete file " << left_new << "x; a stale temporary file " << left_temp << "x");
  CHECK(mid_run >= kills / 4);  // the kills did land inside the conversion

  // The next conversion removes what the killed ones left and leaves nothing but its output.
  convert(input, out);
  CHECK(file_hash(out) == ref_hash);
  CHECK(temporaries(out).empty());
}

}  // namespace

TEST_CASE("crash safety: llmq-convert killed at random points (stories260K)", "[crash][tools]") {
  const std::string dir = test::scratch("crash_prev_stories");
  const std::string previous = dir + "/previous.llmq";
  convert({stories_bin(), "--tokenizer", stories_tok(), "--type", "q4_0"}, previous);
  kill_series("stories", {stories_bin(), "--tokenizer", stories_tok(), "--type", "q8_0"}, previous, 20, 8001);
}

TEST_CASE("crash safety: llmq-convert killed at random points (SmolLM2-135M, 94 MiB)", "[crash][tools][smollm2]") {
  const std::string gguf = smollm2_gguf();
  if (!fs::exists(gguf)) {
    WARN("SKIPPED: " + gguf + " is missing (scripts/fetch_models.sh downloads it)");
    return;
  }
  // The previous output: a different complete model (stories260K), cheap to make.
  const std::string dir = test::scratch("crash_prev_smollm2");
  const std::string previous = dir + "/previous.llmq";
  convert({stories_bin(), "--tokenizer", stories_tok(), "--type", "q8_0"}, previous);
  kill_series("smollm2", {gguf}, previous, 20, 8002);
}

TEST_CASE("crash safety: a writer removes dead writers' temporary files, never a live one's", "[crash][format]") {
  const std::string dir = test::scratch("crash_temporaries");
  const std::string out = dir + "/m.llmq";
  // What SIGKILLed writers leave: unlocked ".m.llmq.tmp.XXXXXX" files. Files that only look
  // similar are not touched.
  for (const char* n : {".m.llmq.tmp.a1B2c3", ".m.llmq.tmp.zzzzzz", ".m.llmq.tmp.long-name", ".n.llmq.tmp.a1B2c3", "m.llmq.tmp.a1B2c3"})
    std::ofstream(dir + "/" + n) << "partial";
  const float v[4] = {1, 2, 3, 4};
  {
    LlmqWriter live(out, true);  // removes the two stale ones; holds its own temporary file
    CHECK_FALSE(fs::exists(dir + "/.m.llmq.tmp.a1B2c3"));
    CHECK_FALSE(fs::exists(dir + "/.m.llmq.tmp.zzzzzz"));
    CHECK(fs::exists(dir + "/.m.llmq.tmp.long-name"));
    CHECK(fs::exists(dir + "/.n.llmq.tmp.a1B2c3"));
    CHECK(fs::exists(dir + "/m.llmq.tmp.a1B2c3"));
    live.declare("t", DType::F32, {4});
    live.begin();
    REQUIRE(temporaries(out).size() == 2);  // its own and .long-name
    {
      // A second writer to the same output (another process would behave the same: flock
      // locks belong to the open file) must leave the live writer's temporary file alone.
      LlmqWriter other(out, true);
      CHECK(temporaries(out).size() == 3);
    }
    CHECK(temporaries(out).size() == 2);
    live.write_tensor(0, v, sizeof v);
    live.finish();
  }
  CHECK(load_error(out) == "");
  CHECK(temporaries(out) == std::vector<std::string>{dir + "/.m.llmq.tmp.long-name"});
}

TEST_CASE("crash safety: disk full at any point of a conversion: clear error, exit 2, nothing left, previous file kept",
          "[crash][tools]") {
  const std::string dir = test::scratch("crash_diskfull");
  const std::string out = dir + "/model.llmq", previous = dir + "/previous.llmq";
  const std::vector<std::string> input{stories_bin(), "--tokenizer", stories_tok(), "--type", "q8_0"};
  convert({stories_bin(), "--tokenizer", stories_tok(), "--type", "q4_0"}, previous);
  const uint64_t prev_hash = file_hash(previous);
  convert(input, out);
  const auto full_size = fs::file_size(out);
  // Limits from "no byte can be written" to "all but the last byte": the failing write is the
  // header's reservation, a tensor early or late, or the last tensor.
  for (const rlim_t limit : {rlim_t(1), rlim_t(4096), rlim_t(65536), rlim_t(200 << 10), rlim_t(full_size - 1)}) {
    for (const bool with_previous : {false, true}) {
      INFO("RLIMIT_FSIZE " << limit << " of " << full_size << " bytes" << (with_previous ? ", previous file in place" : ""));
      fs::remove(out);
      if (with_previous) fs::copy_file(previous, out);
      int err_fd = -1;
      const pid_t pid = spawn(convert_argv(input, out), &err_fd, limit);
      const std::string msg = read_all(err_fd);
      const int rc = reap(pid);
      INFO("stderr: " << msg);
      CHECK(rc == 2);
      CHECK_THAT(msg, Catch::Contains("error") && Catch::Contains("model.llmq") && Catch::Contains("write failed") &&
                          Catch::Contains("File too large"));
      if (with_previous) CHECK(file_hash(out) == prev_hash);
      else CHECK_FALSE(fs::exists(out));
      CHECK(temporaries(out).empty());
    }
  }
}
