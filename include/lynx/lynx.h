// lynx: umbrella header of the public API.
#pragma once

#include "lynx/allocator.h"
#include "lynx/config.h"
#include "lynx/error.h"
#include "lynx/moe.h"
#include "lynx/ranks.h"
#include "lynx/tensor.h"
