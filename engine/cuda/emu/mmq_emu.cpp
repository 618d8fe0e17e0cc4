// The kernels of engine/cuda/mmq.cu compiled for the CPU emulator (engine/cuda/emu/emu.h).
#include "engine/cuda/emu/emu.h"
// The emulator header comes first: it defines the launch macro and the intrinsics the .cu uses.
#include "engine/cuda/mmq.cu"
