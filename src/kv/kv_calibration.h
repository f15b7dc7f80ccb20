// Calibration data for static KV scales and mixed precision: per layer, the
// clipped value range of every K and V channel measured on real text, and
// optionally a per-layer K/V type assignment chosen by measured sensitivity.
// Written by `kvserve calibrate`, read by --kv-calibration.
#pragma once

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

struct KvCalibration {
  std::string model;                  // the checkpoint it was measured on (informational)
  double percentile = 99.9;           // clipping percentile of the ranges
  int64_t tokens = 0;                 // tokens observed
  int kv_dim = 0;
  std::vector<KvChannelRanges> k, v;  // (n_layers)
  // Optional mixed-precision assignment (n_layers entries) and its target.
  std::vector<KvLayerAssignment> assignment;
  double target_bits = 0;             // average bits per K/V value the assignment meets
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

// Makes options use the calibration: the layer assignment (if any) sets each
// layer's K/V types, and with use_static every integer codec (not q4_0) uses
// the layer's fixed per-channel ranges. Throws if the layer count differs.
void apply_kv_calibration(KvCacheOptions& options, const KvCalibration& c, int n_layers, bool use_static);
// The static half alone, after later per-layer overrides (--kv-layers)
// changed types: every affine integer codec takes its layer's ranges, the
// others none. REQUIRES: options.layers has n_layers entries.
void apply_kv_static_ranges(KvCacheOptions& options, const KvCalibration& c, int n_layers);

}  // namespace kvserve
