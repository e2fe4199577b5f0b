// SwitchML-compatible client API, part of netagg: basic types. See context.h.

#ifndef NETAGG_SWITCHML_COMMON_H
#define NETAGG_SWITCHML_COMMON_H

#include <chrono>
#include <cstdint>
#include <limits>

#include "../netagg.hpp"

namespace switchml {

typedef std::uint64_t JobId;
typedef std::int16_t WorkerTid;
typedef std::uint64_t Numel;
typedef std::chrono::steady_clock clock;

/// Unscoped, as in SwitchML: both switchml::FLOAT32 and switchml::DataType::FLOAT32 work.
/// The values are those of netagg_data_type. FLOAT16 (IEEE half precision) and BFLOAT16
/// are netagg's: SwitchML has no 16-bit type. They travel as 2 bytes and are summed in
/// float32 at the switch.
enum DataType {
  FLOAT32 = NETAGG_FLOAT32,
  INT32 = NETAGG_INT32,
  FLOAT16 = NETAGG_FLOAT16,
  BFLOAT16 = NETAGG_BFLOAT16
};

/// Bytes per element: 4, or 2 for the 16-bit types. SwitchML aborts on an unknown type;
/// the signature leaves no room for an error, so netagg returns 0.
static inline std::uint16_t DataTypeSize(enum DataType data_type) {
  switch (data_type) {
    case FLOAT32:
    case INT32:
      return 4;
    case FLOAT16:
    case BFLOAT16:
      return 2;
  }
  return 0;
}

/// A tensor's buffers: the library reads in_ptr and writes out_ptr (the same for in place).
struct Tensor {
  void* in_ptr;
  void* out_ptr;
  Numel numel;
  DataType data_type;

  /// Advances both pointers by `count` elements.
  inline void OffsetPtrs(Numel count) {
    in_ptr = static_cast<char*>(in_ptr) + count * DataTypeSize(data_type);
    out_ptr = static_cast<char*>(out_ptr) + count * DataTypeSize(data_type);
  }
};

}  // namespace switchml

#endif  // NETAGG_SWITCHML_COMMON_H
