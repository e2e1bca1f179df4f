// The row-pass kernels are templates on MR (rows per pass, a compile-time register
// count); a pass's row count is known only at run time. with_rows calls f with
// std::integral_constant<int, rows>, for rows in 1..Max (larger counts get Max).
#pragma once
#include <type_traits>

namespace osd {

template <int Max, int MR = 1, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (MR < Max) {
    if (rows <= MR) {
      f(std::integral_constant<int, MR>{});
      return;
    }
    with_rows<Max, MR + 1>(rows, f);
  } else {
    f(std::integral_constant<int, Max>{});
  }
}

}  // namespace osd
