# Writes the test suites of a GoogleTest program, one a line, to OUT (run after each build of it:
# hpctrial_unit_test's SUITES mode).
#   cmake -D EXE=program -D OUT=file -P gtest_suites.cmake
execute_process(COMMAND "${EXE}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${rc}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
foreach(line IN LISTS lines)
  # A suite's line starts in the first column and ends with '.', before any "# TypeParam" comment.
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    string(APPEND suites "${CMAKE_MATCH_1}\n")
  endif()
endforeach()
file(WRITE "${OUT}.new" "${suites}")
file(RENAME "${OUT}.new" "${OUT}")
