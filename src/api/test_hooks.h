// Hooks for tests only: not part of the public API.
#pragma once

#include "api/workspace_impl.h"

namespace lynx::test_hooks {

// Makes the fused forward's gate/up kernel never load tile `task` (-1 turns the hook off), so that its
// bounded waits must time out and report instead of hanging.
inline void set_stall_task(Workspace& ws, int32_t task) { ws.impl().test_stall_task = task; }

}  // namespace lynx::test_hooks
