// Fused CPU kernels for the explicit training passes of ms_models (ms_models.fused).
//
// Each function is a MindSpore "aot" custom-op entry point: float32 inputs then outputs in
// `params`, every buffer contiguous, row-major. One pass over the data where MindSpore's graph
// runs one kernel per elementwise op (each reading and writing the whole tensor). Single-threaded:
// ms_models uses them only where MindSpore runs one thread per process. Built with -ffast-math
// (vectorized exp): no code here relies on infinities or NaN tests.
#include <cmath>
#include <cstdint>

namespace {

int64_t numel(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

#define AOT_ARGS int nparam, void **p, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra
#define IN(i) static_cast<const float*>(p[i])
#define OUT(i) static_cast<float*>(p[i])

// RMSNorm. x [T, H], weight [H], eps [1] -> y = weight * normed [T, H], normed = x * inv [T, H],
// inv = 1 / sqrt(mean(x^2) + eps) [T, 1].
extern "C" int rms_norm(AOT_ARGS) {
  const float *x = IN(0), *w = IN(1);
  const float eps = IN(2)[0];
  float *y = OUT(3), *normed = OUT(4), *inv = OUT(5);
  const int64_t h = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / h;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float ss = 0.0f;
    for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
    const float k = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    inv[r] = k;
    float *nr = normed + r * h, *yr = y + r * h;
    for (int64_t i = 0; i < h; ++i) {
      nr[i] = xr[i] * k;
      yr[i] = w[i] * nr[i];
    }
  }
  return 0;
}

// dL/dx of RMSNorm. g [T, H], weight [H], normed [T, H], inv [T, 1] ->
// dx = inv * (g w - normed * mean(g w normed)).
extern "C" int rms_norm_dx(AOT_ARGS) {
  const float *g = IN(0), *w = IN(1), *normed = IN(2), *inv = IN(3);
  float* dx = OUT(4);
  const int64_t h = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / h;
  for (int64_t r = 0; r < rows; ++r) {
    const float *gr = g + r * h, *nr = normed + r * h;
    float dot = 0.0f;
    for (int64_t i = 0; i < h; ++i) dot += gr[i] * w[i] * nr[i];
    const float mean = dot / static_cast<float>(h), k = inv[r];
    float* out = dx + r * h;
    for (int64_t i = 0; i < h; ++i) out[i] = k * (gr[i] * w[i] - nr[i] * mean);
  }
  return 0;
}

// Gradient of an elementwise scale: normed [T, H], g [T, H] -> sum over T of normed * g [H].
extern "C" int scale_dw(AOT_ARGS) {
  const float *normed = IN(0), *g = IN(1);
  float* out = OUT(2);
  const int64_t h = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / h;
  for (int64_t i = 0; i < h; ++i) out[i] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float *nr = normed + r * h, *gr = g + r * h;
    for (int64_t i = 0; i < h; ++i) out[i] += nr[i] * gr[i];
  }
  return 0;
}

// SwiGLU. gate, up [N] -> silu(gate) * up.
extern "C" int swiglu(AOT_ARGS) {
  const float *gate = IN(0), *up = IN(1);
  float* out = OUT(2);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
  return 0;
}

// dL/d(gate), dL/d(up) of silu(gate) * up. g, gate, up [N] -> dgate, dup [N].
extern "C" int swiglu_dx(AOT_ARGS) {
  const float *g = IN(0), *gate = IN(1), *up = IN(2);
  float *dgate = OUT(3), *dup = OUT(4);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i], s = sigmoid(x);
    dgate[i] = g[i] * up[i] * s * (1.0f + x * (1.0f - s));
    dup[i] = g[i] * x * s;
  }
  return 0;
}

// Rotary embedding and its input gradient, one function: x [R, heads, d], cos/sin [R, d/2] (R = the
// leading dims, the same rows in both), mode [3] = (interleave, inverse, unused): the forward
// rotates pairs (i, i + d/2), or (2i, 2i + 1) with interleave, and writes the first elements of
// the pairs first; the inverse (the gradient) reads that layout and writes the input's order.
extern "C" int rope(AOT_ARGS) {
  const float *x = IN(0), *cs = IN(1), *sn = IN(2), *mode = IN(3);
  float* out = OUT(4);
  const bool interleave = mode[0] != 0.0f, inverse = mode[1] != 0.0f;
  const int64_t d = shapes[0][ndims[0] - 1], half = d / 2;
  const int64_t rows = numel(ndims[1], shapes[1]) / half;
  const int64_t heads = numel(ndims[0], shapes[0]) / (rows * d);
  if (d % 2 != 0 || shapes[1][ndims[1] - 1] != half || rows * heads * d != numel(ndims[0], shapes[0])) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    const float *c = cs + r * half, *s = sn + r * half;
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* xi = x + (r * heads + hd) * d;
      float* o = out + (r * heads + hd) * d;
      if (!inverse) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = interleave ? xi[2 * i] : xi[i], b = interleave ? xi[2 * i + 1] : xi[i + half];
          o[i] = a * c[i] - b * s[i];
          o[i + half] = b * c[i] + a * s[i];
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const float a = xi[i], b = xi[i + half];
          const float da = a * c[i] + b * s[i], db = b * c[i] - a * s[i];
          if (interleave) {
            o[2 * i] = da;
            o[2 * i + 1] = db;
          } else {
            o[i] = da;
            o[i + half] = db;
          }
        }
      }
    }
  }
  return 0;
}

// Masked softmax of scaled scores. scores [N, M, Sq, Sk] (M: the heads), allowed [N or 1, Sq, Sk]
// (bool, one byte each; one mask for every row of the batch when its first dim is 1), scale [1] ->
// probs [N, M, Sq, Sk]: softmax over Sk of scale * scores where allowed, zero elsewhere (a row with
// nothing allowed is uniform, as a softmax over equal -1e30 would be).
extern "C" int masked_softmax(AOT_ARGS) {
  const float* scores = IN(0);
  const auto* allowed = static_cast<const uint8_t*>(p[1]);
  const float scale = IN(2)[0];
  float* probs = OUT(3);
  const int nd = ndims[0];
  const int64_t sk = shapes[0][nd - 1], sq = shapes[0][nd - 2], n = shapes[0][0];
  const int64_t m = numel(nd, shapes[0]) / (n * sq * sk);
  const bool one_mask = shapes[1][0] == 1;
  if (nd != 4 || ndims[1] != 3 || shapes[1][1] != sq || shapes[1][2] != sk || (!one_mask && shapes[1][0] != n)) return 1;
  for (int64_t b = 0; b < n; ++b)
    for (int64_t h = 0; h < m; ++h)
      for (int64_t q = 0; q < sq; ++q) {
        const float* s = scores + ((b * m + h) * sq + q) * sk;
        const uint8_t* a = allowed + ((one_mask ? 0 : b) * sq + q) * sk;
        float* o = probs + ((b * m + h) * sq + q) * sk;
        bool any = false;
        float top = 0.0f;
        for (int64_t k = 0; k < sk; ++k)
          if (a[k] && (!any || s[k] * scale > top)) {
            top = s[k] * scale;
            any = true;
          }
        if (!any) {  // nothing allowed
          for (int64_t k = 0; k < sk; ++k) o[k] = 1.0f / static_cast<float>(sk);
          continue;
        }
        float sum = 0.0f;
        for (int64_t k = 0; k < sk; ++k) {
          o[k] = a[k] ? std::exp(s[k] * scale - top) : 0.0f;
          sum += o[k];
        }
        const float inv = 1.0f / sum;
        for (int64_t k = 0; k < sk; ++k) o[k] *= inv;
      }
  return 0;
}

// dL/d(scores) of masked_softmax: dp, probs [rows, Sk], scale [1] ->
// scale * probs * (dp - sum(dp * probs)) per row.
extern "C" int softmax_dx(AOT_ARGS) {
  const float *dp = IN(0), *probs = IN(1);
  const float scale = IN(2)[0];
  float* ds = OUT(3);
  const int64_t sk = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / sk;
  for (int64_t r = 0; r < rows; ++r) {
    const float *d = dp + r * sk, *pr = probs + r * sk;
    float dot = 0.0f;
    for (int64_t k = 0; k < sk; ++k) dot += d[k] * pr[k];
    float* o = ds + r * sk;
    for (int64_t k = 0; k < sk; ++k) o[k] = scale * pr[k] * (d[k] - dot);
  }
  return 0;
}

// Next-token cross-entropy. logits [T, V], labels [T] (int32) -> nll [T] = logsumexp(logits) -
// logits[label], residual [T, V] = softmax(logits) - onehot(label); a label outside [0, V) gives
// a NaN loss and no one-hot (never a read outside the row).
extern "C" int cross_entropy(AOT_ARGS) {
  const float* logits = IN(0);
  const auto* labels = static_cast<const int32_t*>(p[1]);
  float *nll = OUT(2), *residual = OUT(3);
  const int64_t v = shapes[0][1], rows = shapes[0][0];
  if (ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != rows) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * v;
    float* o = residual + r * v;
    float top = l[0];
    for (int64_t k = 1; k < v; ++k) top = l[k] > top ? l[k] : top;
    float sum = 0.0f;
    for (int64_t k = 0; k < v; ++k) {
      o[k] = std::exp(l[k] - top);
      sum += o[k];
    }
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k < v; ++k) o[k] *= inv;
    const int32_t y = labels[r];
    if (y < 0 || y >= v) {
      nll[r] = std::nanf("");
      continue;
    }
    nll[r] = top + std::log(sum) - l[y];
    o[y] -= 1.0f;
  }
  return 0;
}
