# Runs a command that must fail cleanly: non-zero exit (not a crash signal),
# a one-line "kvserve: error:" message on stderr containing EXPECT.
# -DCOMMAND="a;b;c" -DEXPECT="substring"
execute_process(COMMAND ${COMMAND} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(rc EQUAL 0)
  message(FATAL_ERROR "command succeeded but should have failed")
endif()
if(NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "command crashed: ${rc}\n${err}")
endif()
string(FIND "${err}" "kvserve: error:" at)
string(FIND "${err}" "${EXPECT}" at2)
if(at EQUAL -1 OR at2 EQUAL -1)
  message(FATAL_ERROR "stderr lacks 'kvserve: error:' with '${EXPECT}':\n${err}")
endif()
