# Runs a command and checks it prints one JSON object on stdout that has
# every field in FIELDS. -DCOMMAND="a;b;c" -DFIELDS="f1;f2"
# Optional -DABOVE="f1=x;f2=y": each such field must be a number above x.
# Optional -DEQUALS="f1=x": each such field must equal x exactly.
cmake_policy(SET CMP0054 NEW)  # quoted if() arguments are strings, not variables
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
# Checks each "field=x" of pairs: mode ABOVE (a number above x) or EQUALS.
function(check_fields mode pairs)
  foreach(entry ${pairs})
    string(REPLACE "=" ";" pair "${entry}")
    list(GET pair 0 field)
    list(GET pair 1 x)
    string(JSON value GET "${out}" ${field})
    if(mode STREQUAL "ABOVE" AND NOT value GREATER x)
      message(FATAL_ERROR "field '${field}' is ${value}, expected above ${x}\n${out}")
    elseif(mode STREQUAL "EQUALS" AND NOT value STREQUAL x)
      message(FATAL_ERROR "field '${field}' is ${value}, expected ${x}\n${out}")
    endif()
  endforeach()
endfunction()
check_fields(ABOVE "${ABOVE}")
check_fields(EQUALS "${EQUALS}")
