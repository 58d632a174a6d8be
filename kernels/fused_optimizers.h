#pragma once
// Forwarding header: kernels/fused_optimizers.h moved to kernels/optim/fused_optimizers.h (kernels/ is grouped by
// feature; docs/design.md). Kept so that code written against the old path builds unchanged.
#include <kernels/optim/fused_optimizers.h>
