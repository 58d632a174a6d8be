#pragma once
// Forwarding header: amp/fused_dense.h moved to amp/nn/fused_dense.h (amp/ is grouped by feature; docs/design.md). Kept
// so that code written against the old path builds unchanged.
#include <amp/nn/fused_dense.h>
