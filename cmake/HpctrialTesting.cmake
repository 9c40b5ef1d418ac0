# Test tiers, run by CTest with labels: unit, mpi, integration, slurm, gpu.
include(GoogleTest)

# Open MPI refuses to run as root unless told; tests set this themselves, users need not.
set(HPCTRIAL_MPI_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")

# CPU as a CTest resource: the resource spec names one "cpus" pool of as many slots as this
# machine has cores (at least 2), and each test that keeps cores busy asks for them
# (RESOURCE_GROUPS): 1 for a test process, all of them for a test whose timing must not share the
# machine (mpirun with its ranks, a benchmark, a compiler). The slurm and pbs tiers ask for none:
# their tests mostly wait on the scheduler, so they run beside whatever holds the cores, one test
# of each tier at a time (their RESOURCE_LOCK). `ctest --parallel` may then exceed the cores by
# those two (scripts/test.sh). The spec file reaches a plain `ctest` through CTestTestfile.cmake.
include(ProcessorCount)
ProcessorCount(HPCTRIAL_TEST_CPUS)
if(HPCTRIAL_TEST_CPUS LESS 2)
  set(HPCTRIAL_TEST_CPUS 2)
endif()
file(WRITE ${PROJECT_BINARY_DIR}/ctest-resources.json
  "{\"version\": {\"major\": 1, \"minor\": 0},\n"
  " \"local\": [{\"cpus\": [{\"id\": \"0\", \"slots\": ${HPCTRIAL_TEST_CPUS}}]}]}\n")
file(WRITE ${PROJECT_BINARY_DIR}/ctest-resources.cmake
  "set(CTEST_RESOURCE_SPEC_FILE \"${PROJECT_BINARY_DIR}/ctest-resources.json\")\n")
set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY TEST_INCLUDE_FILES
  ${PROJECT_BINARY_DIR}/ctest-resources.cmake)
# The test properties that ask for one core, and for all of them.
set(HPCTRIAL_ONE_CPU RESOURCE_GROUPS cpus:1)
set(HPCTRIAL_ALL_CPUS RESOURCE_GROUPS cpus:${HPCTRIAL_TEST_CPUS})

# hpctrial_unit_test(NAME SOURCES ... LIBS ... [LABEL label] [PROPERTIES prop value ...]
#                    [CPUS 1|all|none] [CONCURRENT gtest-filter] [LONG gtest-filter] [SUITES]):
# a gtest binary, each of its tests its own CTest entry with the label (default: unit), the
# cores it asks for (default: 1), a timeout of 300 s and any further test properties. The tests
# that CONCURRENT matches ask for one core whatever CPUS says: they run beside other tests. Those
# that LONG matches get 600 s. With SUITES, each
# test suite is one CTest entry instead (named after the suite, run as `--gtest_filter=Suite.*`):
# for a program whose start-up is a good part of a test's time (LibTorch's is half a second).
function(hpctrial_unit_test name)
  cmake_parse_arguments(ARG "SUITES" "LABEL;CONCURRENT;LONG;CPUS" "SOURCES;LIBS;PROPERTIES" ${ARGN})
  if(NOT ARG_LABEL)
    set(ARG_LABEL unit)
  endif()
  if(ARG_CPUS STREQUAL "all")
    set(cpus ${HPCTRIAL_ALL_CPUS})
  elseif(ARG_CPUS STREQUAL "none")
    set(cpus "")
  else()
    set(cpus ${HPCTRIAL_ONE_CPU})
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest_main GTest::gmock hpctrial_warnings)
  target_compile_definitions(${name} PRIVATE
    HPCTRIAL_SOURCE_DIR="${PROJECT_SOURCE_DIR}" HPCTRIAL_BINARY_DIR="${PROJECT_BINARY_DIR}")
  if(ARG_SUITES)
    if(ARG_CONCURRENT OR ARG_LONG OR ARG_PROPERTIES)
      message(FATAL_ERROR "hpctrial_unit_test(${name}): SUITES takes neither CONCURRENT, LONG nor PROPERTIES")
    endif()
    _hpctrial_test_suites(${name} "${ARG_LABEL}" "${cpus}")
    return()
  endif()
  set(others "")
  if(ARG_CONCURRENT)
    gtest_discover_tests(${name} TEST_FILTER "${ARG_CONCURRENT}"
      PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 300 ${HPCTRIAL_ONE_CPU}
      DISCOVERY_TIMEOUT 60)
    set(others "${ARG_CONCURRENT}")
  endif()
  if(ARG_LONG)
    gtest_discover_tests(${name} TEST_FILTER "${ARG_LONG}"
      PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 600 ${cpus} ${ARG_PROPERTIES}
      DISCOVERY_TIMEOUT 60)
    if(others)
      set(others "${others}:${ARG_LONG}")
    else()
      set(others "${ARG_LONG}")
    endif()
  endif()
  set(rest "")
  if(others)
    set(rest TEST_FILTER "-${others}")
  endif()
  gtest_discover_tests(${name} ${rest}
    PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 300 ${cpus} ${ARG_PROPERTIES}
    DISCOVERY_TIMEOUT 60)
endfunction()

# One CTest entry a suite of the gtest program NAME: after each build the program lists its
# suites (cmake/gtest_suites.cmake), and CTest reads that list through a file of
# TEST_INCLUDE_FILES, as gtest_discover_tests does for single tests.
function(_hpctrial_test_suites name label cpus)
  set(suites ${CMAKE_CURRENT_BINARY_DIR}/${name}.suites)
  add_custom_command(TARGET ${name} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D EXE=$<TARGET_FILE:${name}> -D OUT=${suites}
            -P ${PROJECT_SOURCE_DIR}/cmake/gtest_suites.cmake
    VERBATIM)
  set(tests ${CMAKE_CURRENT_BINARY_DIR}/${name}_suites_tests.cmake)
  file(GENERATE OUTPUT ${tests} CONTENT "if(EXISTS \"${suites}\")
  file(STRINGS \"${suites}\" suites)
  foreach(suite IN LISTS suites)
    add_test(\"\${suite}\" \"$<TARGET_FILE:${name}>\" \"--gtest_filter=\${suite}.*\")
    set_tests_properties(\"\${suite}\" PROPERTIES LABELS \"${label}\" TIMEOUT 300 ${cpus})
  endforeach()
else()
  add_test(${name}_NOT_BUILT ${name}_NOT_BUILT)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${tests})
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
      LABELS mpi ENVIRONMENT "${HPCTRIAL_MPI_TEST_ENV}" ${HPCTRIAL_ALL_CPUS} TIMEOUT 300)
  endforeach()
endfunction()
