#pragma once
// Forwarding header: amp/archive_error.h moved to amp/io/archive_error.h (amp/ is grouped by feature; docs/design.md).
// Kept so that code written against the old path builds unchanged.
#include <amp/io/archive_error.h>
