// Sizes in bytes as users write them: "4096", "512KiB", "64MiB", "2GiB",
// "1.5TiB" (powers of 1024; K, M, G, T alone mean the same), and "KB", "MB",
// "GB", "TB" (powers of 1000).
#pragma once

#include <cstdint>
#include <string_view>

namespace kvserve {

// Throws kvserve::Error naming the text when it is not a size, is negative,
// or exceeds 2^62 bytes.
int64_t parse_byte_size(std::string_view text);

}  // namespace kvserve
