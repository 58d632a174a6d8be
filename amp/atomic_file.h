#pragma once
// Forwarding header: amp/atomic_file.h moved to amp/io/atomic_file.h (amp/ is grouped by feature; docs/design.md). Kept
// so that code written against the old path builds unchanged.
#include <amp/io/atomic_file.h>
