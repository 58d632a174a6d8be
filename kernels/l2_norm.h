#pragma once
// Forwarding header: kernels/l2_norm.h moved to kernels/multi_tensor/l2_norm.h (kernels/ is grouped by feature;
// docs/design.md). Kept so that code written against the old path builds unchanged.
#include <kernels/multi_tensor/l2_norm.h>
