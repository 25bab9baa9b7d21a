# CTest runs the suite of tests/TESTS: one CTest test per line, registered when CMake configures,
# each run by tests/ctest_one.sh through tests/run.sh so that both apply the same rules. One list
# of tests, one runner; `make test` stays the runner's own total.
#
# Labels (ctest -L LABEL) follow from a line's columns, so a new line needs nothing else:
#   multirank  RANKS is a number above 1            slow     TIMEOUT is 180 s or more
#   unit       one process (RANKS "-" or 1) running a tests/test_* program directly, not slow
#   and by name: cuda, ll, lifecycle, doctor, bench, fuzz, example, memcheck, mpi, packaging.
set(EP_TEST_NAME_LABELS
    "^cuda\\." cuda
    "^ll[._]|\\.ll\\." ll
    "^lifecycle\\.|^silent_exit$|^failure$" lifecycle
    "^doctor" doctor
    "^bench\\." bench
    "^fuzz$" fuzz
    "^example\\." example
    "^valgrind$" memcheck
    "^mpi_" mpi
    "^(install|symbols|kernel_names)$" packaging)

function(ep_test_labels var name tmo ranks cmd)
  set(labels "")
  list(LENGTH EP_TEST_NAME_LABELS n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE 0 ${last} 2)
    math(EXPR j "${i} + 1")
    list(GET EP_TEST_NAME_LABELS ${i} re)
    list(GET EP_TEST_NAME_LABELS ${j} label)
    if(name MATCHES "${re}")
      list(APPEND labels ${label})
    endif()
  endforeach()
  if(ranks MATCHES "^[0-9]+$" AND ranks GREATER 1)
    list(APPEND labels multirank)
  endif()
  if(tmo GREATER_EQUAL 180)
    list(APPEND labels slow)
  elseif(ranks MATCHES "^(-|1)$" AND cmd MATCHES "^tests/test_")
    list(APPEND labels unit)
  endif()
  set(${var} ${labels} PARENT_SCOPE)
endfunction()

function(ep_add_suite_tests list)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${list})
  file(STRINGS ${list} lines REGEX "^[^# \t]")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^([^ \t]+)[ \t]+([0-9]+)[ \t]+([^ \t]+)[ \t]+(.+)$")
      message(FATAL_ERROR "${list}: not NAME TIMEOUT RANKS COMMAND: ${line}")
    endif()
    set(name ${CMAKE_MATCH_1})
    set(tmo ${CMAKE_MATCH_2})
    ep_test_labels(labels ${name} ${tmo} ${CMAKE_MATCH_3} "${CMAKE_MATCH_4}")
    add_test(NAME ${name} COMMAND bash ${PROJECT_SOURCE_DIR}/tests/ctest_one.sh ${name} ${PROJECT_BINARY_DIR})
    # run.sh enforces TIMEOUT itself; CTest's limit only catches the runner. Serial: run.sh
    # compares /dev/shm before and after a test, and the timing tests assume an idle machine.
    math(EXPR limit "${tmo} + 30")
    set_tests_properties(${name} PROPERTIES LABELS "${labels}" SKIP_RETURN_CODE 77 TIMEOUT ${limit}
                                            RUN_SERIAL ON)
    if(EP_SANITIZE) # as the Makefile's SAN_ENV does for `make test`
      set_property(TEST ${name} PROPERTY ENVIRONMENT ASAN_OPTIONS=detect_leaks=1
                                                     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)
    endif()
  endforeach()
endfunction()
