# Prints FILE:LINE: N for each top-level function body (from its first line at column 0 to the
# closing brace at column 0) longer than `max` lines. Usage: awk -v max=80 -f function_lengths.awk F.cpp...
FNR == 1 { start = 0 }
/^(namespace|#|\/\/|using|class|struct|enum|template|typedef)/ { start = 0; next }
/^}/ { if (start) { n = FNR - start + 1; if (n > max) print FILENAME ":" start ": " n } start = 0; next }
/^[A-Za-z].*;[ \t]*$/ && !/\{/ { if (!start) next }
/^[A-Za-z]/ { if (!start) start = FNR }
