#pragma once
// Forwarding header: ddp/spawn.h moved to ddp/launch/spawn.h (launching lives in ddp/launch/; docs/design.md). Kept so
// that code written against the old path builds unchanged.
#include <ddp/launch/spawn.h>
