// ggml's tensor element types as GGUF files number them, their block sizes,
// and decoding one row of a block-quantized type into floats.
//
// kvserve computes with F32, F16, Q8_0, Q4_0 and Q4_1 (kernels/weight_matrix.h).
// The other types GGUF checkpoints commonly use (the K-quants, Q5_0, Q5_1,
// BF16) are decoded here at load time and re-encoded into a computable type
// (ggml_load_type); Q4_1 and Q4_K tensors are repacked into Q4_1 where it
// runs natively. The decoders are scalar, since they run once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kernels/weight_matrix.h"

namespace kvserve {

// ggml tensor element types kvserve reads, numbered as in ggml.h. Other
// numbers (IQ quants, Q8_1, Q8_K, TQ…) can appear in a file; they are
// rejected, by name, when a tensor of theirs is used.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
};

constexpr int64_t kSuperBlock = 256;  // values per K-quant super-block (ggml's QK_K)

// Values per block and bytes per block of a ggml type kvserve reads
// (F32: 1 and 4; Q4_K: 256 and 144); both 0 for any other type number.
struct GgmlBlock {
  int64_t values = 0;
  int64_t bytes = 0;
};
GgmlBlock ggml_block(uint32_t type);

// ggml's name of a type number ("Q4_K", "IQ2_XXS"); "unknown" for numbers
// ggml has never used.
std::string ggml_type_name(uint32_t type);
// "Q4_K (ggml type 12)": how messages name a type.
std::string ggml_type_label(uint32_t type);
// The types kvserve reads, for messages: "F32, F16, BF16, Q8_0, ...".
const char* ggml_readable_types();

// The computable type a tensor of this ggml type becomes at load: itself for
// F32/F16/Q8_0/Q4_0 (read in place), F32 for BF16 (exact); Q4_1 for Q4_1
// and Q4_K when native_q4_1 (the caller runs Q4_1 natively: Model::load
// decides), else Q8_0, as for the other block-quantized types; nullopt for
// types kvserve cannot read (whichever native_q4_1).
std::optional<WeightType> ggml_load_type(uint32_t type, bool native_q4_1);
// Whether loading a tensor of this type converts it (readable, not computable
// in place; Q4_1 is copied out of the file even when it stays Q4_1).
bool ggml_needs_conversion(uint32_t type);

// Decodes n values of ggml type t from src into out (n floats).
// REQUIRES: ggml_block(t).values > 0, n is a multiple of it, and src holds
// n / values * bytes bytes. Any bytes decode to some floats (no checks fail).
void dequantize_ggml_row(GgmlType t, const uint8_t* src, int64_t n, float* out);

// Writes n values of ggml type t (Q4_1 or Q4_K) from src into out as
// WeightType::Q4_1 blocks (n / 32 * 20 bytes), without decoding them. Q4_1
// is copied. Each 32-value Q4_K sub-block becomes one Q4_1 block of the same
// 4-bit codes with d = fp16(d_super * sc) and m = fp16(-dmin * min): exact
// but for those two roundings to fp16 (relative error <= 2^-11 each, while
// the products stay within fp16's normal range).
// REQUIRES: t is Q4_1 or Q4_K and n a multiple of ggml_block(t).values.
void repack_ggml_row_q4_1(GgmlType t, const uint8_t* src, int64_t n, uint8_t* out);

}  // namespace kvserve
