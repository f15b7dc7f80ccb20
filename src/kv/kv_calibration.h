// Calibration data for static KV scales and mixed precision: per layer, the
// clipped value range of every K and V channel measured on real text, and
// optionally a per-layer K/V type assignment chosen by measured sensitivity.
// Written by `kvserve calibrate`, read by --kv-calibration.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kv/kv_cache.h"

namespace kvserve {

struct KvChannelRanges {
  std::vector<float> min;  // (kv_dim)
  std::vector<float> max;  // (kv_dim)
};

struct KvLayerAssignment {
  KvDType k = KvDType::F16;
  KvDType v = KvDType::F16;
};

// The cache layout an assignment's sensitivity was measured with (calibrate
// --kv-bits): everything but the per-layer types, which the assignment sets.
// An assignment chosen under one layout can be far from the best under
// another (channel keys before RoPE with a 32-token window: KL 0.0046; the
// same assignment in the default layout: 0.55).
struct KvCalibrationLayout {
  int32_t block_size = 16;  // tokens per block
  int32_t residual = -1;    // tokens kept in FP16 (-1: one block)
  // grouping, group_size, pre_rope, rope_span, scale_bits and outliers; the
  // dtype and static ranges are not part of the layout.
  KvCodecConfig k, v;
  bool static_scales = true;  // the candidates used the calibrated ranges (else dynamic scales)
};

struct KvCalibration {
  std::string model;                  // the checkpoint's path when measured (informational)
  std::string model_fingerprint;      // Model::fingerprint() of that checkpoint; empty in older files
  double percentile = 99.9;           // clipping percentile of the ranges
  int64_t tokens = 0;                 // tokens observed
  int kv_dim = 0;
  std::vector<KvChannelRanges> k, v;  // (n_layers)
  // Optional mixed-precision assignment (n_layers entries) and its target.
  std::vector<KvLayerAssignment> assignment;
  double target_bits = 0;             // average bits per K/V value the assignment meets
  std::optional<KvCalibrationLayout> layout;  // with an assignment; absent in older files
  // Measured sensitivity: mean KL divergence from the FP32-KV model when only
  // (layer, K or V) is quantized to each type.
  struct Sensitivity {
    int layer;
    bool is_key;
    KvDType dtype;
    double kl_divergence;
  };
  std::vector<Sensitivity> sensitivity;
};

// Throws kvserve::Error on I/O errors or malformed content.
void save_kv_calibration(const std::string& path, const KvCalibration& c);
KvCalibration load_kv_calibration(const std::string& path);

// Throws kvserve::Error when the file records a fingerprint (model_fingerprint)
// other than `fingerprint`, the model's it is to be used with: ranges and an
// assignment measured on another checkpoint of the same shape would load
// without complaint otherwise. Files without one (older ones) pass.
void check_kv_calibration_model(const KvCalibration& c, const std::string& path, const std::string& fingerprint);

// Sets options' block size (unless keep_block_size), residual window and
// K/V codec layout to the recorded one, keeping their types.
void apply_kv_calibration_layout(KvCacheOptions& options, const KvCalibrationLayout& layout, bool keep_block_size);

// Makes options use the calibration: the layer assignment (if any) sets each
// layer's K/V types, and with use_static every integer codec (not q4_0) uses
// the layer's fixed per-channel ranges. Throws if the layer count differs.
void apply_kv_calibration(KvCacheOptions& options, const KvCalibration& c, int n_layers, bool use_static);
// The static half alone, after later per-layer overrides (--kv-layers)
// changed types: every affine integer codec takes its layer's ranges, the
// others none. REQUIRES: options.layers has n_layers entries.
void apply_kv_static_ranges(KvCacheOptions& options, const KvCalibration& c, int n_layers);

}  // namespace kvserve
