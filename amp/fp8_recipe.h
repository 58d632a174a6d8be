#pragma once
// Forwarding header: amp/fp8_recipe.h moved to amp/fp8/fp8_recipe.h (amp/ is grouped by feature; docs/design.md). Kept
// so that code written against the old path builds unchanged.
#include <amp/fp8/fp8_recipe.h>
