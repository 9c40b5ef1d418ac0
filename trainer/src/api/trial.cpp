#include "hpctrial/trainer/trial.h"

namespace hpctrial::trainer {

Metrics Trial::evaluate_batch(Batch& /*batch*/) { throw detail::NotOverridden{}; }

MetricValues Trial::evaluate_full_dataset(DataLoader& /*loader*/) { throw detail::NotOverridden{}; }

}  // namespace hpctrial::trainer
