#include "util/byte_size.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include "util/error.h"

namespace kvserve {

int64_t parse_byte_size(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + i, value);
  if (i == 0 || ec != std::errc() || end != text.data() + i)
    fail("'{}' is not a size (expected e.g. 4096, 512MiB, 2GiB)", text);
  const std::string_view unit = text.substr(i);
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KiB" || unit == "K") mult = 0x1p10;
  else if (unit == "MiB" || unit == "M") mult = 0x1p20;
  else if (unit == "GiB" || unit == "G") mult = 0x1p30;
  else if (unit == "TiB" || unit == "T") mult = 0x1p40;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else fail("unknown size unit '{}' in '{}' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", unit, text);
  const double bytes = value * mult;
  if (!(bytes <= 0x1p62)) fail("size '{}' is too large", text);
  return int64_t(bytes);
}

}  // namespace kvserve
