# One precompiled LibTorch for the programs of this tree that use the trainer (tests, benchmarks,
# examples, hpctrial-worker, whose own source is a one-line main). torch/torch.h is most of such
# a source's compile time (some 45 s on a 2-core machine); read from a precompiled header it is a
# few seconds. The trainer library keeps its own (it is built position-independent, these programs
# are not).
#
# hpctrial_share_torch_pch(DIR...): every executable defined under DIR (recursively) that links
# hpctrial::trainer or hpctrial_trainer_internal reuses hpctrial_torch_pch's precompiled header.
# hpctrial_share_torch_pch(TESTS DIR...): the same, but a test (a program that links GoogleTest)
# reuses hpctrial_test_pch's, which adds GoogleTest's headers.
#
# These programs compile at -O1 (where the build type optimizes): what they run fast is in
# LibTorch and hpctrial's libraries, which keep the build type's optimization (and a benchmark
# compares sides compiled alike). -O1 about halves the compile time of each of their LibTorch
# sources (a benchmark's, with the precompiled header: 6 s against 11 s). The header is compiled
# at the same level as the programs that read it: GCC 12 crashes on an -O1 header in an -O2
# program.
set(_hpctrial_program_optimization $<$<OR:$<CONFIG:RelWithDebInfo>,$<CONFIG:Release>,$<CONFIG:MinSizeRel>>:-O1>)
add_library(hpctrial_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
# The definitions and include paths of a program that links the trainer, for the header to be valid in it.
target_link_libraries(hpctrial_torch_pch PRIVATE hpctrial::trainer hpctrial_warnings)
target_compile_options(hpctrial_torch_pch PRIVATE ${_hpctrial_program_optimization})
target_precompile_headers(hpctrial_torch_pch PRIVATE <torch/torch.h>)

if(HPCTRIAL_BUILD_TESTS)
  add_library(hpctrial_test_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
  target_link_libraries(hpctrial_test_pch PRIVATE hpctrial::trainer GTest::gtest GTest::gmock hpctrial_warnings)
  target_compile_options(hpctrial_test_pch PRIVATE ${_hpctrial_program_optimization})
  target_precompile_headers(hpctrial_test_pch PRIVATE <torch/torch.h> <gtest/gtest.h> <gmock/gmock.h>)
endif()

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
  cmake_parse_arguments(ARG "" "" "TESTS" ${ARGN})
  # A header precompiled without -fPIC is invalid in programs built position-independent.
  if(CMAKE_POSITION_INDEPENDENT_CODE)
    return()
  endif()
  set(dirs ${ARG_UNPARSED_ARGUMENTS} ${ARG_TESTS})
  foreach(dir ${dirs})
    _hpctrial_targets_under(${dir} targets)
    foreach(target ${targets})
      get_target_property(type ${target} TYPE)
      if(NOT type STREQUAL "EXECUTABLE")
        continue()
      endif()
      get_target_property(libraries ${target} LINK_LIBRARIES)
      if(libraries MATCHES "(hpctrial::trainer|hpctrial_trainer_internal)")
        if(ARG_TESTS AND libraries MATCHES "GTest::")
          target_precompile_headers(${target} REUSE_FROM hpctrial_test_pch)
        else()
          target_precompile_headers(${target} REUSE_FROM hpctrial_torch_pch)
        endif()
        target_compile_options(${target} PRIVATE ${_hpctrial_program_optimization})
      endif()
    endforeach()
  endforeach()
endfunction()
