// How two values of a searcher metric compare, one way for the whole project: the loop's best
// metric, checkpoint retention and the ranking of trials. Non-finite values (NaN, +-inf: a
// diverged run) rank after every finite one, whatever the direction, and never displace one.
#pragma once

#include <cmath>

namespace hpctrial::core {

// True when `a` is strictly better than `b`.
inline bool metric_better(double a, double b, bool smaller_is_better) {
  const bool a_finite = std::isfinite(a);
  const bool b_finite = std::isfinite(b);
  if (a_finite != b_finite) return a_finite;
  if (!a_finite) return false;  // neither is a result to prefer
  return smaller_is_better ? a < b : a > b;
}

}  // namespace hpctrial::core
