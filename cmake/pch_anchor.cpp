// Anchor translation unit for the shared precompiled LibTorch header (see cmake/LibtorchAmpTargets.cmake).
