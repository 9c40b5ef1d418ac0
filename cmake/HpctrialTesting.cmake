# Test tiers, run by CTest with labels: unit, mpi, integration, slurm, gpu.
include(GoogleTest)

# Open MPI refuses to run as root unless told; tests set this themselves, users need not.
set(HPCTRIAL_MPI_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")

# hpctrial_unit_test(NAME SOURCES ... LIBS ... [LABEL label] [PROPERTIES prop value ...]
#                    [CONCURRENT gtest-filter]):
# a gtest binary, each of its tests its own CTest entry with the label (default: unit) and
# any further test properties. The tests that CONCURRENT matches get the label alone: they run
# beside other tests, where the PROPERTIES would say otherwise (RUN_SERIAL).
function(hpctrial_unit_test name)
  cmake_parse_arguments(ARG "" "LABEL;CONCURRENT" "SOURCES;LIBS;PROPERTIES" ${ARGN})
  if(NOT ARG_LABEL)
    set(ARG_LABEL unit)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest_main GTest::gmock hpctrial_warnings)
  target_compile_definitions(${name} PRIVATE
    HPCTRIAL_SOURCE_DIR="${PROJECT_SOURCE_DIR}" HPCTRIAL_BINARY_DIR="${PROJECT_BINARY_DIR}")
  if(ARG_CONCURRENT)
    gtest_discover_tests(${name} TEST_FILTER "${ARG_CONCURRENT}"
      PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 300
      DISCOVERY_TIMEOUT 60)
    set(rest TEST_FILTER "-${ARG_CONCURRENT}")
  endif()
  gtest_discover_tests(${name} ${rest}
    PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 300 ${ARG_PROPERTIES}
    DISCOVERY_TIMEOUT 60)
endfunction()

# hpctrial_mpi_test(NAME SOURCES... LIBS ... [RANKS n ...]): a gtest binary with its own main
# (tests/mpi/mpi_test_main.cpp), run under `mpirun -np 2` and `mpirun -np 4 --oversubscribe`
# (or each number of RANKS).
function(hpctrial_mpi_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;RANKS" ${ARGN})
  if(NOT ARG_RANKS)
    set(ARG_RANKS 2 4)
  endif()
  add_executable(${name} ${ARG_SOURCES} ${PROJECT_SOURCE_DIR}/tests/mpi/mpi_test_main.cpp)
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} hpctrial::comm GTest::gtest hpctrial_warnings)
  foreach(np ${ARG_RANKS})
    set(extra "")
    if(np GREATER 2)
      set(extra --oversubscribe)
    endif()
    add_test(NAME ${name}.np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${extra} --timeout 240
                     $<TARGET_FILE:${name}>)
    set_tests_properties(${name}.np${np} PROPERTIES
      LABELS mpi ENVIRONMENT "${HPCTRIAL_MPI_TEST_ENV}" RUN_SERIAL TRUE TIMEOUT 300)
  endforeach()
endfunction()
