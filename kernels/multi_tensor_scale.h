#pragma once
// Forwarding header: kernels/multi_tensor_scale.h moved to kernels/multi_tensor/multi_tensor_scale.h (kernels/ is
// grouped by feature; docs/design.md). Kept so that code written against the old path builds unchanged.
#include <kernels/multi_tensor/multi_tensor_scale.h>
