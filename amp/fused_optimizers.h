#pragma once
// Forwarding header: amp/fused_optimizers.h moved to amp/optim/fused_optimizers.h (amp/ is grouped by feature;
// docs/design.md). Kept so that code written against the old path builds unchanged.
#include <amp/optim/fused_optimizers.h>
