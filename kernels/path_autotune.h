#pragma once
// Forwarding header: kernels/path_autotune.h moved to kernels/gemm/path_autotune.h (kernels/ is grouped by feature;
// docs/design.md). Kept so that code written against the old path builds unchanged.
#include <kernels/gemm/path_autotune.h>
