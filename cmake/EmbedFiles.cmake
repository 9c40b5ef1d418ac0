# cmake -DOUT=file.cpp -DDIR=dir -DFILES=a,b -DSYMBOL=name -P EmbedFiles.cmake: writes a C++
# source defining `const hpctrial::cli::EmbeddedFile SYMBOL[]` (and SYMBOL_count) with the
# files' names and texts, as raw string literals.
set(text "// Written by cmake/EmbedFiles.cmake from ${DIR}; do not edit.\n#include \"embedded_files.h\"\n\nnamespace hpctrial::cli {\n\nconst EmbeddedFile ${SYMBOL}[] = {\n")
set(count 0)
string(REPLACE "," ";" FILES "${FILES}")
foreach(name ${FILES})
  file(READ ${DIR}/${name} content)
  string(FIND "${content}" ")hpctrial_file\"" clash)
  if(NOT clash EQUAL -1)
    message(FATAL_ERROR "${DIR}/${name} holds the raw string's delimiter")
  endif()
  string(APPEND text "    {\"${name}\", R\"hpctrial_file(${content})hpctrial_file\"},\n")
  math(EXPR count "${count} + 1")
endforeach()
string(APPEND text "};\nconst std::size_t ${SYMBOL}_count = ${count};\n\n}  // namespace hpctrial::cli\n")
file(WRITE ${OUT}.tmp "${text}")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
