/* JSON output of the tools (`epcomm bench --json`, `epcomm doctor --json`, the baselines). */
#ifndef EP_TK_JSON_H
#define EP_TK_JSON_H

#include <stdio.h>

/* s as a JSON string: quotes and backslashes escaped, control characters as \n, \t or \u00XX,
 * valid UTF-8 copied, any other byte as U+FFFD (logs are bytes; JSON must be UTF-8). */
void tk_json_str(FILE *f, const char *s);

/* A finite number with %.6g; NaN and infinities (which JSON lacks) as null. */
void tk_json_num(FILE *f, double v);

#endif
