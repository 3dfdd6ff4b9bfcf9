// The FP8 quantisation kernels' translation units, each its own module: load_quantize_kernels (api.h,
// quantize_tiles.cu) loads every one.
#pragma once

namespace lynx::fp8 {

void load_quantize_blocks_module();
void load_transpose_tiles_module();
void load_tile_rows_module();

}  // namespace lynx::fp8
