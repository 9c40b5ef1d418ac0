# One precompiled LibTorch for the programs of this tree that use the trainer (tests, benchmarks,
# examples, hpctrial-worker). torch/torch.h is most of such a source's compile time (some 45 s on a
# 2-core machine); read from a precompiled header it is a few seconds. The trainer library keeps
# its own (it is built position-independent, these programs are not).
#
# hpctrial_share_torch_pch(DIR...): every executable defined under DIR (recursively) that links
# hpctrial::trainer or hpctrial_trainer_internal reuses hpctrial_torch_pch's precompiled header.
add_library(hpctrial_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
# The definitions and include paths of a program that links the trainer, for the header to be valid in it.
target_link_libraries(hpctrial_torch_pch PRIVATE hpctrial::trainer hpctrial_warnings)
target_precompile_headers(hpctrial_torch_pch PRIVATE <torch/torch.h>)

function(_hpctrial_targets_under dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub ${subdirs})
    _hpctrial_targets_under(${sub} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(hpctrial_share_torch_pch)
  # A header precompiled without -fPIC is invalid in programs built position-independent.
  if(CMAKE_POSITION_INDEPENDENT_CODE)
    return()
  endif()
  foreach(dir ${ARGN})
    _hpctrial_targets_under(${dir} targets)
    foreach(target ${targets})
      get_target_property(type ${target} TYPE)
      if(NOT type STREQUAL "EXECUTABLE")
        continue()
      endif()
      get_target_property(libraries ${target} LINK_LIBRARIES)
      if(libraries MATCHES "(hpctrial::trainer|hpctrial_trainer_internal)")
        target_precompile_headers(${target} REUSE_FROM hpctrial_torch_pch)
      endif()
    endforeach()
  endforeach()
endfunction()
