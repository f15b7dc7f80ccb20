# Runs a command and checks it prints one JSON object on stdout that has
# every field in FIELDS. -DCOMMAND="a;b;c" -DFIELDS="f1;f2"
execute_process(COMMAND ${COMMAND} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "command failed (${rc}): ${err}")
endif()
foreach(field ${FIELDS})
  string(JSON value ERROR_VARIABLE json_error GET "${out}" ${field})
  if(json_error)
    message(FATAL_ERROR "field '${field}' missing: ${json_error}\n${out}")
  endif()
endforeach()
