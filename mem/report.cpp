#include "mem/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/error.h"

namespace llmq::mem {

int release_code(const std::string& v, const std::string& flag) {
  int major = 0, minor = 0, used = 0;
  if (std::sscanf(v.c_str(), "%d.%d%n", &major, &minor, &used) != 2 || major < 0 || minor < 0 || minor > 999 ||
      (v[size_t(used)] != '\0' && v[size_t(used)] != '.'))
    throw UsageError(flag + " '" + v + "': expected MAJOR.MINOR (e.g. 4.44 or 2.5)");
  return major * 1000 + minor;
}

const char* place_name(Place p) {
  switch (p) {
    case Place::Device: return "device";
    case Place::GpuOther: return "gpu-other";
    case Place::Cpu: return "cpu";
    case Place::Nvme: return "nvme";
    default: return "info";
  }
}

const char* basis_name(Basis b) {
  switch (b) {
    case Basis::Exact: return "exact";
    case Basis::Formula: return "formula";
    case Basis::Assumed: return "assumed";
    case Basis::Measured: return "measured";
    default: return "not measured";
  }
}

double MemReport::total(Place place) const {
  double t = 0;
  for (const auto& l : lines)
    if (l.place == place && l.place != Place::Info && l.basis != Basis::NotMeasured) t += l.bytes;
  return t;
}

std::optional<bool> MemReport::fits() const {
  if (!budget) return std::nullopt;
  return device_total() <= *budget;
}

std::string format_bytes(double b) {
  if (b < 1024.0 * 1024.0) return fmt::format("{:.0f} B", b);
  const double gib = b / double(1ull << 30);
  if (gib >= 1.0) return fmt::format("{:.2f} GiB ({:.2f} GB)", gib, b / 1e9);
  return fmt::format("{:.2f} MiB ({:.2f} MB)", b / double(1ull << 20), b / 1e6);
}

std::string render_table(const MemReport& r) {
  std::string out = r.title + (r.device.empty() ? "" : " [" + r.device + "]") + "\n";
  size_t w = 10;
  for (const auto& l : r.lines) w = std::max(w, l.name.size());
  out += fmt::format("  {:<{}}  {:>26}  {:<9}  {:<12} {}\n", "line", w, "bytes", "place", "basis", "formula");
  for (const auto& l : r.lines) {
    const std::string b = l.basis == Basis::NotMeasured ? "-" : format_bytes(l.bytes);
    out += fmt::format("  {:<{}}  {:>26}  {:<9}  {:<12} {}\n", l.name, w, b, place_name(l.place), basis_name(l.basis), l.formula);
  }
  out += fmt::format("  {:<{}}  {:>26}\n", "TOTAL (device)", w, format_bytes(r.device_total()));
  if (r.total(Place::Cpu) > 0) out += fmt::format("  {:<{}}  {:>26}\n", "total on CPU", w, format_bytes(r.total(Place::Cpu)));
  if (r.total(Place::Nvme) > 0) out += fmt::format("  {:<{}}  {:>26}\n", "total on NVMe", w, format_bytes(r.total(Place::Nvme)));
  if (r.budget)
    out += fmt::format("  fits in {}: {}\n", format_bytes(*r.budget), *r.fits() ? "yes" : "NO");
  for (const auto& n : r.notes) out += "  note: " + n + "\n";
  std::vector<std::string> sources;
  for (const auto& l : r.lines)
    if (!l.source.empty() && std::find(sources.begin(), sources.end(), l.source) == sources.end()) sources.push_back(l.source);
  for (const auto& s : sources) out += "  source: " + s + "\n";
  return out;
}

nlohmann::json report_json(const MemReport& r) {
  nlohmann::json j = r.extra.is_object() ? r.extra : nlohmann::json::object();
  j["title"] = r.title;
  j["device"] = r.device;
  nlohmann::json lines = nlohmann::json::array();
  for (const auto& l : r.lines) {
    nlohmann::json e{{"name", l.name},       {"place", place_name(l.place)}, {"basis", basis_name(l.basis)},
                     {"formula", l.formula}, {"source", l.source}};
    if (l.basis == Basis::NotMeasured) e["bytes"] = nullptr;
    else e["bytes"] = std::llround(l.bytes);
    lines.push_back(e);
  }
  j["lines"] = lines;
  j["totals"] = {{"device", std::llround(r.total(Place::Device))},
                 {"gpu_other", std::llround(r.total(Place::GpuOther))},
                 {"cpu", std::llround(r.total(Place::Cpu))},
                 {"nvme", std::llround(r.total(Place::Nvme))},
                 {"device_total", std::llround(r.device_total())}};
  j["budget"] = r.budget ? nlohmann::json(std::llround(*r.budget)) : nlohmann::json(nullptr);
  j["fits"] = r.fits() ? nlohmann::json(*r.fits()) : nlohmann::json(nullptr);
  j["notes"] = r.notes;
  return j;
}

namespace {

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

constexpr const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                                   "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#2f4b7c", "#a05195"};

// Layout: bars 80 px wide side by side, 400 px tall for the largest total (or budget), legend below.
struct SvgLayout {
  double bar_h = 400, bar_w = 80, gap = 60, left = 90, top = 40;
  double scale_max = 1;  // bytes at the top of the axis
  double width = 0;      // px
};

// The axis: five ticks from 0 to scale_max, in GiB.
std::string svg_axis(const SvgLayout& L) {
  std::string s;
  for (int i = 0; i <= 4; ++i) {  // axis ticks
    const double y = L.top + L.bar_h - L.bar_h * i / 4.0;
    s += fmt::format("<line x1=\"{}\" x2=\"{:.0f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L.left - 5, L.width - 20, y, y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.2f} GiB</text>\n", L.left - 8, y + 4,
                     L.scale_max * i / 4.0 / double(1ull << 30));
  }
  return s;
}

// Report b's stacked bar (its device and GPU lines), its legend from row ly on (ly advances), its budget line.
std::string svg_bar(const SvgLayout& L, const MemReport& r, size_t b, double& ly) {
  const double bar_h = L.bar_h, bar_w = L.bar_w, top = L.top, scale_max = L.scale_max;
  const double x = L.left + double(b) * (bar_w + L.gap);
  double y = top + bar_h;
  std::string s = fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" text-anchor=\"middle\">{}</text>\n", x + bar_w / 2, top + bar_h + 18,
                              xml_escape(r.device));
  s += fmt::format("<text x=\"20\" y=\"{:.0f}\" font-weight=\"bold\">{}: total {}</text>\n", ly, xml_escape(r.device),
                   xml_escape(format_bytes(r.device_total())));
  ly += 16;
  for (size_t i = 0; i < r.lines.size(); ++i) {
    const MemLine& l = r.lines[i];
    const char* color = kColors[i % (sizeof kColors / sizeof kColors[0])];
    const bool drawn = (l.place == Place::Device || l.place == Place::GpuOther) && l.basis != Basis::NotMeasured && l.bytes > 0;
    if (drawn) {
      const double h = bar_h * l.bytes / scale_max;
      y -= h;
      s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.2f}\" width=\"{}\" height=\"{:.2f}\" fill=\"{}\"><title>{}: {}</title></rect>\n",
                       x, y, bar_w, h, color, xml_escape(l.name), xml_escape(format_bytes(l.bytes)));
    }
    s += fmt::format("<rect x=\"20\" y=\"{:.0f}\" width=\"10\" height=\"10\" fill=\"{}\"/>", ly - 9, drawn ? color : "#fff");
    s += fmt::format("<text x=\"36\" y=\"{:.0f}\">{} — {} ({}, {})</text>\n", ly, xml_escape(l.name),
                     l.basis == Basis::NotMeasured ? "not measured" : xml_escape(format_bytes(l.bytes)), place_name(l.place),
                     basis_name(l.basis));
    ly += 16;
  }
  if (r.budget) {
    const double by = top + bar_h - bar_h * *r.budget / scale_max;
    s += fmt::format("<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n",
                     x - 10, x + bar_w + 10, by, by);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.2f}\">budget</text>\n", x + bar_w + 12, by + 4);
  }
  ly += 16;
  return s;
}

}  // namespace

std::string render_svg(const std::vector<MemReport>& reports) {
  SvgLayout L;
  size_t legend_rows = 0;
  for (const auto& r : reports) {
    L.scale_max = std::max(L.scale_max, r.device_total());
    if (r.budget) L.scale_max = std::max(L.scale_max, *r.budget);
    legend_rows += r.lines.size() + 2;
  }
  L.width = std::max(720.0, L.left + double(reports.size()) * (L.bar_w + L.gap) + 40);
  const double legend_top = L.top + L.bar_h + 50;
  const double height = legend_top + double(legend_rows) * 16 + 20;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      L.width, height);
  s += fmt::format("<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n", L.left,
                   xml_escape(reports.empty() ? "" : reports[0].title));
  s += svg_axis(L);
  double ly = legend_top;
  for (size_t b = 0; b < reports.size(); ++b) s += svg_bar(L, reports[b], b, ly);
  s += "</svg>\n";
  return s;
}

}  // namespace llmq::mem
