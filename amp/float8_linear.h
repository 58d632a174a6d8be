#pragma once
// Forwarding header: amp/float8_linear.h moved to amp/nn/float8_linear.h (amp/ is grouped by feature; docs/design.md).
// Kept so that code written against the old path builds unchanged.
#include <amp/nn/float8_linear.h>
