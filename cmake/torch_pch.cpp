// The one source of hpctrial_torch_pch (cmake/HpctrialTorchPch.cmake): it exists to build the
// precompiled torch/torch.h that the programs using the trainer reuse.
