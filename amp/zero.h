#pragma once
// Forwarding header: amp/zero.h moved to amp/zero/zero.h (amp/ is grouped by feature; docs/design.md). Kept so that
// code written against the old path builds unchanged.
#include <amp/zero/zero.h>
