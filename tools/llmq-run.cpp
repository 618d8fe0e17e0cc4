// llmq-run: generate text from a `.llmq` model (one-shot or interactive), or measure perplexity.
//
//   llmq-run -m model.llmq -p "Once upon a time" -n 128 --temp 0      one-shot, streamed
//   llmq-run -m model.llmq                                             interactive (chat with a template)
//   llmq-run -m model.llmq --perplexity text.txt --ctx 256             llama.cpp-method PPL
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "text/chat.h"
#include "base/mapped_file.h"
#include "engine/runner/device.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "text/tokenizer.h"
#include "engine/parallel/comm_mpi.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"
#include "base/error.h"
#include "mem/infer.h"
#include "cli/cli_common.h"

using namespace llmq;

namespace {

std::atomic<bool> g_generating{false};
std::atomic<bool> g_stop{false};

// Ctrl-C stops the current generation; at the prompt it ends the program.
void on_sigint(int) {
  if (g_generating.load()) {
    g_stop.store(true);
  } else {
    const char nl = '\n';
    (void)!write(STDOUT_FILENO, &nl, 1);
    _exit(130);
  }
}

void print_stats(const GenerateStats& st) {
  std::fprintf(stderr,
               "\nllmq-run: prompt %lld tokens, %.1f tok/s prefill | generated %lld tokens, %.1f tok/s decode | peak memory %s\n",
               (long long)st.prompt_tokens, st.prefill_tps(), (long long)st.generated_tokens, st.decode_tps(),
               cli::human_bytes(cli::peak_rss_bytes()).c_str());
}

std::string read_text_file(const std::string& path) {
  std::ifstream in = open_regular_file(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The command line, checked by main.
struct RunOptions {
  std::string model_path, prompt, ppl_file, template_name, system_prompt, kv_type_s = "f32", device_s = "cpu", mem_budget,
      gpu_layers_s = "all";
  bool have_prompt = false, no_verify = false, use_chat = false, fit = false;
  int64_t n_predict = 256, ctx = 0, n_batch = 512, seed = -1, ppl_chunks = 0;
  int threads = 0, tp = 1;
  SamplerParams sp;
};

// --fit on the CPU: the largest context that fits --mem (or MemAvailable), planned from the
// file's metadata and tensor directory before loading; the plan as JSON on stderr.
void fit_cpu(RunOptions& o) {
  if (!o.ppl_file.empty()) throw UsageError("--fit plans generation, not --perplexity");
  const double budget = o.mem_budget.empty() ? double(mem::available_memory()) : mem::parse_size(o.mem_budget);
  auto f = LlmqFile::open(o.model_path, false);
  const ModelConfig c = mem::file_config(*f);
  mem::InferOptions io;
  io.ctx = o.ctx, io.n_batch = o.n_batch, io.threads = o.threads, io.kv_type = o.kv_type_s;
  const mem::FitResult r = mem::fit_inference(*f, c, io, budget, o.ctx > 0, true);
  std::fprintf(stderr, "llmq-run: fit plan: %s\n", mem::fit_json(r, budget).dump().c_str());
  if (!r.fits) throw UsageError("the model does not fit in " + cli::human_bytes(uint64_t(budget)) + " even with the smallest context");
  o.ctx = r.options.ctx;
}

// The settings every path shares after the model is loaded.
struct Loaded {
  Device device;
  int64_t gpu_layers;
  bool partial, gpu_kv_q8;
  KvType kv_type;  // the CPU's (with a GPU: f32 for the CPU layers of a partial offload)
  int64_t ppl_ctx;
};

// What runs the model (engine/runner/runner.h): one sequence, sized for generation or, with
// --perplexity, for whole chunks of every position's logits. Under mpirun (`group`) this process's
// rank of the job (engine/parallel/tp_process.h); the ranks other than 0 serve rank 0.
std::unique_ptr<Runner> make_run_runner(const RunOptions& o, const Model& model, const Loaded& L, MpiComm* group) {
  RunnerOptions ro;
  ro.place = Placement{L.device, L.gpu_layers, o.tp};
  ro.threads = o.threads, ro.ctx = o.ctx, ro.n_batch = o.n_batch, ro.kv_type = L.kv_type, ro.gpu_kv_q8 = L.gpu_kv_q8;
  if (!o.ppl_file.empty()) ro.ctx = ro.n_batch = ro.logits_rows = L.ppl_ctx;
  if (group) {
    cli::check_tp_flags(o.tp, L.partial);
    if (L.device == Device::Cuda && !o.ppl_file.empty())
      throw UsageError("--perplexity under mpirun with --device cuda: the GPU ranks keep one logits row (use the CPU ranks, or one process)");
  }
  cli::join_tp_group(group, model, ro);
  return cli::make_tool_runner("llmq-run", model, ro);
}

int run_perplexity(const RunOptions& o, const Model& model, SessionBase& session, const Loaded& L) {
  const int64_t n_ctx = L.ppl_ctx;
  const std::vector<int32_t> tokens = model.tokenizer->encode(read_text_file(o.ppl_file), model.vocab.add_bos);  // as llama.cpp: BOS only where the model takes one
  std::fprintf(stderr, "llmq-run: perplexity over %s: %zu tokens, %lld chunks of %lld\n", o.ppl_file.c_str(), tokens.size(),
               (long long)(int64_t(tokens.size()) / n_ctx), (long long)n_ctx);
  const auto progress = [](int64_t i, double ppl) { std::fprintf(stderr, "[%lld] %.4f\n", (long long)i + 1, ppl); };
  const PerplexityResult r = perplexity(session, tokens, n_ctx, progress, o.ppl_chunks);
  std::printf("PPL = %.4f +/- %.4f (%lld chunks, %lld tokens scored, ctx %lld, model %s)\n", r.ppl, r.ppl_err, (long long)r.chunks,
              (long long)r.scored, (long long)n_ctx, model.weight_type().c_str());
  return 0;
}

// Measured at load on the CPU: bytes of our own buffers (the mapping, the weights the CPU
// kernels repacked, the KV cache, the workspace), what llmq-mem infer predicts.
void print_memory(const Model& model, const SessionBase& session, KvType kv_type) {
  const uint64_t file_bytes = model.file->file_size(), packed = model.packed.bytes();
  const uint64_t total = file_bytes + packed + session.state_bytes();
  std::fprintf(stderr,
               "llmq-run: memory: model file %s (weights %s), repacked weights %s, KV cache %s (%s), workspace %s; total %llu bytes "
               "(%s), ctx %lld\n",
               cli::human_bytes(file_bytes).c_str(), cli::human_bytes(model.weight_bytes()).c_str(), cli::human_bytes(packed).c_str(),
               cli::human_bytes(session.kv_bytes()).c_str(), kv_type_name(kv_type), cli::human_bytes(session.workspace_bytes()).c_str(),
               (unsigned long long)total, cli::human_bytes(total).c_str(), (long long)session.ctx());
}

// A conversation with the session: one-shot (-p) or interactive, plain text or chat. In chat
// mode the conversation is formatted with the model's template (or --chat-template) and
// re-tokenized each turn; the KV cache keeps the prefix that did not change.
class Conversation {
 public:
  Conversation(const RunOptions& o, const Model& model, SessionBase& session)
      : o_(o), model_(model), tok_(*model.tokenizer), session_(session), sampler_(o.sp), stop_ids_(default_stop_ids(model.vocab)) {
    chat_ = o.use_chat || (!o.have_prompt && (!o.template_name.empty() || !model.chat_template.empty()));
    if (chat_) {
      if (!o.template_name.empty()) tmpl_ = ChatTemplate::by_name(o.template_name);
      else if (!model.chat_template.empty()) tmpl_ = ChatTemplate::for_vocab(model.chat_template, model.vocab);
      else throw UsageError("the model has no chat template: name one with --chat-template (chatml, llama2, ...)");
    }
    if (!o.system_prompt.empty()) messages_.push_back({"system", o.system_prompt});
    bos_text_ = model.vocab.bos_id >= 0 ? model.vocab.tokens[size_t(model.vocab.bos_id)] : "";
  }

  int one_shot() {
    if (chat_) {
      chat_turn(o_.prompt);
    } else {
      history_ = tok_.encode(o_.prompt, model_.vocab.add_bos);
      if (history_.empty()) throw UsageError("the prompt is empty and the model adds no BOS token");
      check_fits(history_.size());
      for (int32_t id : history_) emit(id);  // echo the prompt as the model sees it
    }
    const GenerateStats st = generate(session_, sampler_, history_, o_.n_predict, stop_ids_, [&](int32_t id) { return emit(id); });
    std::printf("\n");
    print_stats(st);
    return 0;
  }

  // Each line is a user turn (chat mode) or continues the text; the KV cache is kept between
  // turns. Ctrl-C stops a reply, /reset forgets, /quit or end of input exits.
  int interactive() {
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    const bool tty = isatty(STDIN_FILENO);
    std::fprintf(stderr, "llmq-run: %s; Ctrl-C stops a reply, /reset forgets, /quit or end of input exits\n",
                 chat_ ? ("chat (template " + tmpl_->name() + ")").c_str() : "interactive text continuation");
    GenerateStats total;
    std::string line;
    for (;;) {
      if (tty) std::fprintf(stderr, "> ");
      if (!std::getline(std::cin, line)) break;
      if (line == "/quit" || line == "/exit") break;
      if (line == "/reset") {
        reset();
        std::fprintf(stderr, "(conversation reset)\n");
        continue;
      }
      if (line.empty() || !take_line(line)) continue;
      g_stop = false;
      g_generating = true;
      const GenerateStats st = generate(session_, sampler_, history_, o_.n_predict, stop_ids_, [&](int32_t id) { return emit(id); }, &g_stop);
      g_generating = false;
      std::printf("\n");
      std::fflush(stdout);
      if (g_stop) std::fprintf(stderr, "(stopped)\n");
      if (chat_) messages_.push_back({"assistant", reply_});
      total.prompt_tokens += st.prompt_tokens, total.generated_tokens += st.generated_tokens;
      total.prefill_s += st.prefill_s, total.decode_s += st.decode_s;
    }
    print_stats(total);
    return 0;
  }

 private:
  bool emit(int32_t id) {
    const std::string piece = tok_.decode_piece(prev_, id);
    prev_ = id;
    reply_ += piece;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return true;
  }
  void check_fits(size_t n) const {
    if (int64_t(n) >= session_.ctx())
      throw UsageError("the prompt has " + std::to_string(n) + " tokens; the context is " + std::to_string(session_.ctx()));
  }
  void chat_turn(const std::string& user) {
    messages_.push_back({"user", user});
    const std::string text = tmpl_->apply(messages_, true);
    const bool add_bos = model_.vocab.add_bos && (bos_text_.empty() || text.rfind(bos_text_, 0) != 0);
    std::vector<int32_t> want = tok_.encode(text, add_bos, /*parse_special=*/true);
    check_fits(want.size() + 1);
    size_t common = 0;
    while (common + 1 < want.size() && common < history_.size() && int64_t(common) < session_.pos() && history_[common] == want[common])
      ++common;
    session_.truncate(int64_t(common));
    history_ = std::move(want);
    prev_ = history_.back();
    reply_.clear();
  }
  void reset() {
    session_.reset();
    history_.clear();
    messages_.clear();
    if (!o_.system_prompt.empty()) messages_.push_back({"system", o_.system_prompt});
    prev_ = -1;
  }
  // An interactive line into the history; false when it was refused (the reason on stderr).
  bool take_line(const std::string& line) {
    try {
      if (chat_) {
        try {
          chat_turn(line);
        } catch (const UsageError&) {  // context full: start over with this message alone
          std::fprintf(stderr, "(context full: conversation reset)\n");
          reset();
          chat_turn(line);
        }
        return true;
      }
      std::vector<int32_t> add = tok_.encode(line, history_.empty() && model_.vocab.add_bos);
      if (int64_t(history_.size() + add.size()) + 1 >= session_.ctx()) {
        std::fprintf(stderr, "(context full: conversation reset)\n");
        reset();
        add = tok_.encode(line, model_.vocab.add_bos);
        check_fits(add.size() + 1);
      }
      history_.insert(history_.end(), add.begin(), add.end());
      prev_ = add.back();
      return true;
    } catch (const UsageError& e) {
      std::fprintf(stderr, "(%s)\n", e.what());
      reset();
      return false;
    }
  }

  const RunOptions& o_;
  const Model& model_;
  const Tokenizer& tok_;
  SessionBase& session_;
  Sampler sampler_;
  const std::vector<int32_t> stop_ids_;
  bool chat_ = false;
  std::optional<ChatTemplate> tmpl_;
  std::vector<ChatMessage> messages_;
  std::string bos_text_;
  std::vector<int32_t> history_;  // every token of the conversation (prompt and replies)
  int32_t prev_ = -1;
  std::string reply_;
};

// The flags, checked; the model loaded; then perplexity or a conversation.
int run(RunOptions& o) {
  const Device device = pick_device(o.device_s);
  // Under mpirun: MPI initialised here, on the main thread; the group outlives the runner.
  const std::unique_ptr<MpiComm> group = cli::start_mpi_group(o.tp);
  if (o.fit && device == Device::Cuda) {  // on the GPU, --fit picks the layers that fit (--gpu-layers auto)
    if (o.gpu_layers_s != "all" && o.gpu_layers_s != "auto") throw UsageError("--fit with --device cuda chooses --gpu-layers itself");
    o.gpu_layers_s = "auto";
  }
  if (o.fit && device == Device::Cpu) fit_cpu(o);
  if (device == Device::Cuda && o.kv_type_s != "f32" && o.kv_type_s != "f16" && o.kv_type_s != "q8_0")
    throw UsageError("--kv-type with --device cuda: f16 (the default) or q8_0");
  Loaded L;
  L.device = device;
  L.gpu_kv_q8 = device == Device::Cuda && o.kv_type_s == "q8_0";
  L.kv_type = device == Device::Cuda ? KvType::F32 : kv_type_from_name(o.kv_type_s);
  mem::InferOptions lo;
  lo.ctx = o.ctx, lo.n_batch = o.n_batch;
  L.gpu_layers = cli::resolve_gpu_layers("llmq-run", o.gpu_layers_s, device == Device::Cuda, o.model_path, lo, o.mem_budget);
  // The CPU kernels' packed copies only for what the CPU runs (with -ngl 0 the output is packed
  // too, unused).
  auto model = load_model(o.model_path, !o.no_verify, Placement{device, L.gpu_layers, o.tp, false, o.ctx});
  L.partial = device == Device::Cuda && L.gpu_layers >= 0 && L.gpu_layers < model->config.n_layers;
  L.ppl_ctx = o.ctx > 0 ? o.ctx : 512;
  o.sp.seed = o.seed >= 0 ? uint64_t(o.seed) : uint64_t(time(nullptr));
  std::unique_ptr<Runner> runner = make_run_runner(o, *model, L, group.get());
  if (runner->follower()) return runner->serve();  // a following rank: rank 0's forward passes, quietly
  SessionBase& session = runner->session();
  if (!o.ppl_file.empty()) return run_perplexity(o, *model, session, L);
  if (device == Device::Cpu) print_memory(*model, session, L.kv_type);
  Conversation conv(o, *model, session);
  return o.have_prompt ? conv.one_shot() : conv.interactive();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-run: generate text with a .llmq model"};
  RunOptions o;
  o.sp.seed = 0;
  app.add_option("model,-m,--model", o.model_path, "model file (.llmq, GGUF or a Hugging Face directory; positional or -m)")->required();
  auto* popt = app.add_option("-p,--prompt", o.prompt, "prompt; without it llmq-run is an interactive chat");
  app.add_option("-n,--n-predict", o.n_predict, "tokens to generate (-1: until end of sequence)");
  app.add_option("-t,--threads", o.threads, "threads in all (default: all cores); with --tp they are shared by the ranks");
  app.add_option("--tp", o.tp, "tensor-parallel ranks: split every layer over N ranks (CPU: rank threads in this process; --device cuda: one rank per GPU over NCCL when N GPUs are present, else N ranks on GPU 0 with a host all-reduce). "
                              "Under `mpirun -np N` (one machine or several): one rank per process, --tp N; rank 0 generates, the others serve it");
  app.add_option("-c,--ctx", o.ctx, "context length, KV cache size in tokens (default: the model's, at most 4096)");
  app.add_option("-b,--batch", o.n_batch, "most tokens per forward pass during prefill");
  app.add_option("--kv-type", o.kv_type_s, "KV cache element type: f32, or bf16 (half the memory; attention on bf16 operands); "
                                          "--device cuda: f16 (default) or q8_0 (17/32 of f16's bytes)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "q8_0"}));
  app.add_option("--device", o.device_s, "where the forward pass runs: cpu, cuda (GPU 0; f16 KV cache) or auto (the GPU when one is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--temp", o.sp.temperature, "temperature (0: greedy)");
  app.add_option("--top-k", o.sp.top_k, "top-k (0: off)");
  app.add_option("--top-p", o.sp.top_p, "top-p (1: off)");
  app.add_option("--min-p", o.sp.min_p, "min-p (0: off)");
  app.add_option("--repeat-penalty", o.sp.repeat_penalty, "repetition penalty (1: off)");
  app.add_option("--repeat-last-n", o.sp.repeat_last_n, "tokens the repetition penalty looks back on");
  app.add_option("-s,--seed", o.seed, "random seed (default: from the clock)");
  app.add_option("--perplexity", o.ppl_file, "compute perplexity over this text file instead of generating");
  app.add_option("--chunks", o.ppl_chunks, "perplexity: score only the first N chunks (0: all)");
  app.add_option("--chat-template", o.template_name, "chat template name, overriding the model's (chatml, llama2, llama3, mistral, zephyr, gemma, phi3)");
  app.add_option("--system", o.system_prompt, "system prompt for chat mode");
  app.add_flag("--chat", o.use_chat, "format -p as a user message with the chat template (interactive mode chats whenever the model has a template)");
  app.add_flag("--no-verify", o.no_verify, "skip the tensor checksum verification at load");
  app.add_flag("--fit", o.fit,
               "before loading, pick the largest context (multiple of 16, at most the model's) that fits --mem and print the "
               "plan as JSON on stderr (llmq-mem infer --fit); with --device cuda: --gpu-layers auto within --mem or the GPU's free "
               "memory");
  app.add_option("--mem", o.mem_budget, "memory budget for --fit, e.g. 2GiB (default: MemAvailable)");
  app.add_option("--gpu-layers,--n-gpu-layers", o.gpu_layers_s,
                 "with --device cuda: the last N layers (and the output) on the GPU, the others on the CPU (partial offload); "
                 "'auto': as many as fit the GPU's free memory (or --mem) by llmq-mem's plan; default: all");
  LLMQ_CLI_PARSE(app, argc, argv);
  o.have_prompt = popt->count() > 0;
  return cli::run_guarded("llmq-run", [&] { return run(o); });
}
