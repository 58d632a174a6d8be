#pragma once
// Forwarding header: ddp/launch_env.h moved to ddp/launch/launch_env.h (launching lives in ddp/launch/;
// docs/design.md). Kept so that code written against the old path builds unchanged.
#include <ddp/launch/launch_env.h>
