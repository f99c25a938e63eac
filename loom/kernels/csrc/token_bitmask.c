/* Structured output: set to -inf the logits of the tokens a grammar forbids (loom/sample/structured.py).
 *
 * masks: int32 words, row r's at masks + r * words; bit t % 32 of word t / 32 set = token t allowed (the layout
 * of llguidance and xgrammar). A row whose words are all zero (nothing allowed) is left as it is. Words that are
 * all ones (inside a JSON string, most of them) cost one compare. Portable C: one build for every CPU.
 */
#include <math.h>
#include <stdint.h>

void loom_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *masks, const int64_t *rows,
                              int64_t num_rows, int64_t vocab, int64_t words) {
    for (int64_t r = 0; r < num_rows; r++) {
        const int32_t *m = masks + r * words;
        int any = 0;
        for (int64_t w = 0; w < words; w++) {
            if (m[w] != 0) {
                any = 1;
                break;
            }
        }
        if (!any) continue;
        float *row = logits + rows[r] * row_stride;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32;
            int64_t n = base + 32 < vocab ? 32 : vocab - base;
            float *x = row + base;
            if (bits == 0) {
                for (int64_t k = 0; k < n; k++) x[k] = -INFINITY;
                continue;
            }
            for (int64_t k = 0; k < n; k++) x[k] = ((bits >> k) & 1u) ? x[k] : -INFINITY; /* no branch */
        }
        for (int64_t t = words * 32; t < vocab; t++) row[t] = -INFINITY; /* beyond the mask: forbidden */
    }
}
