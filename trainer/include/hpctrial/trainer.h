// Everything a trial needs: #include <hpctrial/trainer.h>.
#pragma once

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/accumulator.h"
#include "hpctrial/trainer/callback.h"
#include "hpctrial/trainer/core_context.h"
#include "hpctrial/trainer/data.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/grad_scaler.h"
#include "hpctrial/trainer/load.h"
#include "hpctrial/trainer/lr_schedulers.h"
#include "hpctrial/trainer/main.h"
#include "hpctrial/trainer/metrics.h"
#include "hpctrial/trainer/pipeline.h"
#include "hpctrial/trainer/random.h"
#include "hpctrial/trainer/sampler.h"
#include "hpctrial/trainer/summary_writer.h"
#include "hpctrial/trainer/trial.h"
#include "hpctrial/trainer/trial_context.h"

namespace hpctrial {
using trainer::Accumulator;
using trainer::Batch;
using trainer::Callback;
using trainer::CoreContext;
using trainer::DataLoader;
using trainer::DataIterator;
using trainer::DataLoaderOptions;
using trainer::Dataset;
using trainer::derive_seed;
using trainer::EngineTrial;
using trainer::EngineTrialContext;
using trainer::GradScaler;
using trainer::GradScalerOptions;
using trainer::Hdf5Dataset;
using trainer::LayerSpec;
using trainer::load_trial_from_checkpoint;
using trainer::LoadedTrial;
using trainer::LoadOptions;
using trainer::Metrics;
using trainer::ModelEngine;
using trainer::ModelParallelUnit;
using trainer::MetricValues;
using trainer::PipelineLoss;
using trainer::PipelineModule;
using trainer::PipelineOptions;
using trainer::ReduceLROnPlateau;
using trainer::ReduceLROnPlateauOptions;
using trainer::Reducer;
using trainer::StepMode;
using trainer::StreamDataset;
using trainer::StreamOrder;
using trainer::TensorDataset;
using trainer::Trial;
using trainer::TrainingSampler;
using trainer::TrialContext;
}  // namespace hpctrial
