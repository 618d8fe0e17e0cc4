// A memory report: lines of bytes per device, each with its formula and source, rendered as a
// text table, JSON or an SVG stacked bar chart. Shared by `llmq-mem infer` and `llmq-mem train`.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace llmq::mem {

/// Where a line's bytes live. Only Gpu and GpuOther lines add up to a GPU's total; Device is
/// the memory of the device the report is for when that is not a GPU (llmq-mem infer --device cpu).
enum class Place {
  Device,    ///< the report's device memory, allocated by the engine / framework
  GpuOther,  ///< on the GPU but outside the framework's allocator statistics (CUDA context)
  Cpu,       ///< host memory (offload)
  Nvme,      ///< NVMe (offload)
  Info,      ///< a comparison or remark, not a memory line (never summed)
};
const char* place_name(Place p);  ///< "device", "gpu-other", "cpu", "nvme", "info"

/// How a line's number was obtained.
enum class Basis {
  Exact,        ///< counted from the file or the engine's allocation plan
  Formula,      ///< a closed form (its source is cited)
  Assumed,      ///< a constant we did not measure (stated as such)
  Measured,     ///< measured: in this process (built as the engine builds it) or a stated reference run
  NotMeasured,  ///< cannot be known yet (e.g. no CUDA backend): bytes = 0, excluded from totals
};
const char* basis_name(Basis b);  ///< "exact", "formula", "assumed", "measured", "not measured"

/// One line of a report.
struct MemLine {
  std::string name;     ///< e.g. "optimizer states"
  double bytes = 0;     ///< bytes on one device (fractional values come from /N formulas)
  std::string formula;  ///< how the number was computed: symbols, then the values used
  std::string source;   ///< paper, documentation or code it follows ("" for our own files)
  Place place = Place::Device;
  Basis basis = Basis::Formula;
};

/// One device's report.
struct MemReport {
  std::string title;                 ///< e.g. "llama-2-7b, ZeRO-2 over 8 GPUs, per GPU"
  std::string device;                ///< e.g. "gpu 0", "cpu"
  std::vector<MemLine> lines;
  std::vector<std::string> notes;    ///< assumptions and caveats, printed under the table
  std::optional<double> budget;      ///< bytes available (--mem / --gpu-mem), if given
  nlohmann::json extra;              ///< tool-specific fields copied into the JSON (plan sizes, ...)

  /// Σ bytes of the lines in `place` (NotMeasured and Info lines never count).
  double total(Place place) const;
  /// Device + GpuOther: what the device must hold.
  double device_total() const { return total(Place::Device) + total(Place::GpuOther); }
  /// device_total() <= *budget; nullopt without a budget.
  std::optional<bool> fits() const;
};

/// Bytes as "12.34 GiB (13.25 GB)"; below 1 MiB as "123456 B".
std::string format_bytes(double bytes);

/// A release "MAJOR.MINOR[.PATCH]" (transformers, PyTorch) as MAJOR·1000 + MINOR, so releases
/// compare as integers. Throws UsageError naming `flag` for anything else (e.g. "4", "v4.45").
int release_code(const std::string& version, const std::string& flag);

/// A fixed-width text table: name, bytes, basis, formula; then totals, fits, notes and sources.
std::string render_table(const MemReport& r);

/// {"title", "device", "lines": [{name, bytes, place, basis, formula, source}], "totals":
/// {device, gpu_other, cpu, nvme, device_total}, "budget", "fits", "notes", ...extra}.
nlohmann::json report_json(const MemReport& r);

/// A self-contained SVG: one stacked bar per report (device), a segment per line with bytes > 0
/// in Device/GpuOther, a legend with the values, and a dashed line at the budget when given.
std::string render_svg(const std::vector<MemReport>& reports);

}  // namespace llmq::mem
