#pragma once
// Forwarding header: kernels/unscale.h moved to kernels/multi_tensor/unscale.h (kernels/ is grouped by feature;
// docs/design.md). Kept so that code written against the old path builds unchanged.
#include <kernels/multi_tensor/unscale.h>
