#include "tk_json.h"

#include <math.h>

/* Length of the valid UTF-8 sequence starting at s, or 0. */
static int utf8_len(const unsigned char *s) {
  int n = s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC2 && s[0] < 0xE0 ? 2 : 0;
  for (int i = 1; i < n; i++)
    if ((s[i] & 0xC0) != 0x80) return 0;
  return n;
}

void tk_json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\') {
      fprintf(f, "\\%c", *p);
    } else if (*p < 0x20) {
      fprintf(f, *p == '\n' ? "\\n" : *p == '\t' ? "\\t" : "\\u%04x", *p);
    } else if (*p < 0x80) {
      fputc(*p, f);
    } else {
      int n = utf8_len(p);
      if (n)
        fwrite(p, 1, (size_t)n, f), p += n - 1;
      else
        fputs("\\ufffd", f);
    }
  }
  fputc('"', f);
}

void tk_json_num(FILE *f, double v) {
  if (isfinite(v))
    fprintf(f, "%.6g", v);
  else
    fputs("null", f);
}
