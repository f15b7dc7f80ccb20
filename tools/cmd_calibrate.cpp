// kvserve calibrate: static KV ranges and a mixed-precision assignment,
// measured on real text.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "engine/kv_calibrator.h"
#include "tools/cli_common.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

struct CalibrateArgs {
  CommonOptions common;
  std::string data;
  std::string out;
  CalibrateOptions calib;
};

void run(CalibrateArgs a) {
  auto model = load_model(a.common);
  const Tokenizer& tok = model->require_tokenizer();
  const std::vector<int32_t> tokens = tok.encode(read_text_file(a.data, "--data"), tok.add_bos_default());

  if (!a.common.kv_calibration.empty())
    fail("calibrate measures its own ranges and reads no calibration: drop --kv-calibration");
  if (!a.common.kv_scales.empty() && a.common.kv_scales != "static" && a.common.kv_scales != "dynamic")
    fail("--kv-scales must be static or dynamic");
  a.calib.static_scales = a.common.kv_scales != "dynamic";
  // The candidates' layout comes from the usual KV flags (grouping, groups,
  // residual, block size); calibration itself is not read here.
  CommonOptions layout = a.common;
  layout.kv_scales.clear();
  if (layout.kv_k_grouping.empty() && layout.kv_grouping.empty()) layout.kv_k_grouping = "channel";
  a.calib.layout = kv_options(layout, *model, /*refuse_unused=*/false);
  // Both would fail only after the measurements (minutes on a real model).
  check_writable_file(a.out, "--out");
  if (a.calib.target_bits > 0 && a.calib.static_scales && a.calib.layout.k.pre_rope)
    fail("pre-RoPE keys with static scales are not supported (calibration measures keys after RoPE): pass "
         "--kv-scales dynamic");

  ThreadPool pool(thread_count(a.common));
  Transformer transformer(*model, pool);
  const bool tty = isatty(fileno(stderr));
  auto progress = [&](const std::string& stage, int32_t done, int32_t total) {
    if (!tty && done != total) return;
    std::fprintf(stderr, "\rcalibrate %s %d/%d", stage.c_str(), done, total);
    if (done == total) std::fprintf(stderr, "\n");
  };
  const KvCalibration cal = calibrate_kv(transformer, tokens, tok.bos_id(), a.calib, progress);
  save_kv_calibration(a.out, cal);

  nlohmann::json j = {{"out", a.out}, {"tokens", cal.tokens}, {"percentile", cal.percentile}, {"layers", cal.k.size()}};
  if (!cal.assignment.empty()) {
    j["target_bits"] = cal.target_bits;
    for (const auto& as : cal.assignment)
      j["assignment"].push_back(std::string(kv_dtype_name(as.k)) + "/" + std::string(kv_dtype_name(as.v)));
  }
  if (a.common.json) {
    print_json(j);
    return;
  }
  std::printf("wrote %s: ranges of %zu layers from %lld tokens (%.2f%% clipping)\n", a.out.c_str(), cal.k.size(),
              (long long)cal.tokens, 100.0 - cal.percentile);
  for (size_t l = 0; l < cal.assignment.size(); ++l)
    std::printf("  layer %zu: K %s, V %s\n", l, std::string(kv_dtype_name(cal.assignment[l].k)).c_str(),
                std::string(kv_dtype_name(cal.assignment[l].v)).c_str());
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto a = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand("calibrate", "measure static KV ranges and a mixed-precision assignment");
  add_common_options(*cmd, a->common);
  cmd->add_option("--data", a->data, "calibration text file")->required();
  cmd->add_option("--out", a->out, "output JSON")->required();
  cmd->add_option("--ctx", a->calib.ctx, "tokens per chunk")->capture_default_str();
  cmd->add_option("--chunks", a->calib.range_chunks, "chunks observed for the ranges")->capture_default_str();
  cmd->add_option("--skip-chunks", a->calib.skip_chunks, "chunks at the start of the text to leave out (held out)")
      ->capture_default_str();
  cmd->add_option("--percentile", a->calib.percentile, "clipping percentile per channel")->capture_default_str();
  cmd->add_option("--kv-bits", a->calib.target_bits, "average bits per K/V value for a per-layer assignment (0 = none)")
      ->capture_default_str();
  cmd->add_option("--sensitivity-chunks", a->calib.sensitivity_chunks, "chunks per sensitivity measurement")
      ->capture_default_str();
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
