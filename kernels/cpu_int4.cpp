// A CPU kernel for x @ W.T with W in 4-bit groups (kernels/cpu_int4.py says why and what it computes).
//
// x [M, K] bfloat16; W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n] with u in 0..15 and g = k / 32.
// packed [N / 16, K / 4, 32] uint8: for outputs n0 .. n0 + 15 and inputs k .. k + 3, byte 2i holds u[n0 + i, k] (low
// nibble) and u[n0 + i, k + 2] (high), byte 2i + 1 holds u[n0 + i, k + 1] and u[n0 + i, k + 3]. Widened to 16 bits
// and or-ed with 0x4300, a nibble u is the bfloat16 value 128 + u exactly, and the 32 values of a vector are the pairs
// (k, k + 1) of 16 outputs that one VDPBF16PS multiplies with a pair of inputs (exact products, float32 sums).
// Per group and output: sum_k x_k W[n, k] = scale * (sum_k x_k (128 + u_k) - 136 X) + zero * X, X = sum_k x_k.
// Every row runs the same instructions in the same order whatever the number of rows: a row's result never depends
// on the rows beside it.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <torch/extension.h>

namespace {

constexpr int64_t kGroup = 32, kBlockN = 16, kRowsMax = 8;

inline float bf16_value(uint16_t b) {  // one bfloat16 -> float32, exactly
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_round(float x) { return bf16_value(c10::BFloat16(x).x); }  // rounded to bfloat16 (nearest even)

inline __m512 widen_bf16(const uint16_t* p) {  // 16 bfloat16 -> float32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int R>
void block(const uint16_t* x, int64_t K, const float* xsum, int64_t G, const uint8_t* w, const uint16_t* scale,
           const uint16_t* zero, int64_t N, int64_t n0, uint16_t* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const __m512 offset = _mm512_set1_ps(136.0f);
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const uint8_t* p = w + g * (kGroup / 4) * 32;
    for (int q = 0; q < kGroup / 4; ++q) {
      const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + q * 32)));
      const __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(wide, low), bias);
      const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(wide, 4), bias);
      const int64_t k = g * kGroup + q * 4;
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + k;
        dot[r] = _mm512_dpbf16_ps(dot[r], lo, (__m512bh)_mm512_set1_epi32(*(const int32_t*)xr));
        dot[r] = _mm512_dpbf16_ps(dot[r], hi, (__m512bh)_mm512_set1_epi32(*(const int32_t*)(xr + 2)));
      }
    }
    const __m512 s = widen_bf16(scale + g * N + n0), z = widen_bf16(zero + g * N + n0);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_set1_ps(xsum[r * G + g]);
      acc[r] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(offset, sum, dot[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(z, sum, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_si256((__m256i*)(out + r * N + n0), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using BlockFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, const uint16_t*,
                         const uint16_t*, int64_t, int64_t, uint16_t*);
constexpr BlockFn kBlocks[kRowsMax] = {block<1>, block<2>, block<3>, block<4>, block<5>, block<6>, block<7>, block<8>};

}  // namespace

torch::Tensor int4_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero.scalar_type() == at::kBFloat16, "scale, zero: bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && N % kBlockN == 0, "K a multiple of 32, N of 16");
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == N * K / 2 && scale.size(0) == G && zero.sizes() == scale.sizes(),
              "packed [N/16, K/4, 32], scale and zero [K/32, N]");
  TORCH_CHECK(scale.is_contiguous() && zero.is_contiguous(), "scale and zero contiguous");
  auto out = torch::empty({M, N}, x.options());
  auto sums = torch::empty({M, G}, x.options().dtype(at::kFloat));
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  float* sp = sums.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {  // group sums, in one fixed order per row
    const uint16_t* v = xp + i * kGroup;
    __m512 a = _mm512_add_ps(widen_bf16(v), widen_bf16(v + 16));
    sp[i] = _mm512_reduce_add_ps(a);
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* scp = (const uint16_t*)scale.data_ptr<at::BFloat16>();
  const uint16_t* zp = (const uint16_t*)zero.data_ptr<at::BFloat16>();
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowsMax) {
        const int64_t rows = std::min<int64_t>(kRowsMax, M - m0);
        kBlocks[rows - 1](xp + m0 * K, K, sp + m0 * G, G, wp + nb * (K / 4) * 32, scp, zp, N, nb * kBlockN, op + m0 * N);
      }
    }
  });
  return out;
}

// ---- 8-bit groups (the Q8_0 LM head): W[n, k] = scale[g, n] * q[n, k], q in -128..127 -------------------------
// packed [N / 16, K / 2, 32] int8: byte 2i + e of pair p holds q[n0 + i, 2p + e]. Widened to float32 and narrowed to
// bfloat16 (exact: 8 significant bits), a pair's 32 values are the VDPBF16PS operand of 16 outputs.

namespace {

template <int R>
void block8(const uint16_t* x, int64_t K, int64_t G, const int8_t* w, const uint16_t* scale, int64_t N, int64_t n0,
            uint16_t* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int8_t* p = w + g * (kGroup / 2) * 32;
    for (int j = 0; j < kGroup / 2; ++j) {
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + j * 32))));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + j * 32 + 16))));
      const __m512bh wv = _mm512_cvtne2ps_pbh(b, a);  // outputs 0..7 from a, 8..15 from b
      const int64_t k = g * kGroup + 2 * j;
      for (int r = 0; r < R; ++r)
        dot[r] = _mm512_dpbf16_ps(dot[r], wv, (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + r * K + k)));
    }
    const __m512 s = widen_bf16(scale + g * N + n0);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(s, dot[r], acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_si256((__m256i*)(out + r * N + n0), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using Block8Fn = void (*)(const uint16_t*, int64_t, int64_t, const int8_t*, const uint16_t*, int64_t, int64_t, uint16_t*);
constexpr Block8Fn kBlocks8[kRowsMax] = {block8<1>, block8<2>, block8<3>, block8<4>,
                                         block8<5>, block8<6>, block8<7>, block8<8>};

}  // namespace

torch::Tensor int8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && scale.scalar_type() == at::kBFloat16, "bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && N % kBlockN == 0 && scale.size(0) == G && scale.is_contiguous(), "shapes");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == N * K, "packed");
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const uint16_t* sp = (const uint16_t*)scale.data_ptr<at::BFloat16>();
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsMax)
        kBlocks8[std::min<int64_t>(kRowsMax, M - m0) - 1](xp + m0 * K, K, G, wp + nb * K * 16, sp, N, nb * kBlockN,
                                                          op + m0 * N);
  });
  return out;
}

// ---- attention of a few queries per row over a float32 cache (kernels/cpu_int4.py: attend) ----------------------

namespace {

inline __m512 exp_ps(__m512 x) {  // e^x for x <= 0 (Cephes' polynomial; about 1 ulp), 0 below -87
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(y, fx));
}

// a row's scores buf[0..n) -> e^(score - top) in place; returns 1 / their sum (summed sixteen lanes at a time)
inline float exp_in_place(float* buf, int64_t n, float top) {
  const __m512 m = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, buf + i), m)));
    _mm512_mask_storeu_ps(buf + i, live, p);
    total = _mm512_add_ps(total, p);
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// 16 cached values as float32: a float32 cache as it is, a bfloat16 one widened (exactly: the same values either way)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return widen_bf16(p); }

// one query row: q [D] float, the keys/values of its kv head at the slots idx[0..n) (ascending), out [D] bfloat16
template <typename E>
void attend_row(const float* q, const E* k, const E* v, int64_t stride, const int32_t* idx, int64_t n, int64_t D,
                float scale, float* buf, uint16_t* out) {
  const int64_t chunks = D / 16;
  __m512 qv[16];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const E* kr = k + idx[i] * stride;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kr));
    for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), acc);
    const float s = _mm512_reduce_add_ps(acc) * scale;
    buf[i] = s;
    top = s > top ? s : top;
  }
  const float inv = exp_in_place(buf, n, top);
  __m512 o[16];
  for (int64_t c = 0; c < chunks; ++c) o[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m512 p = _mm512_set1_ps(buf[i]);
    const E* vr = v + idx[i] * stride;
    for (int64_t c = 0; c < chunks; ++c) o[c] = _mm512_fmadd_ps(p, load16(vr + 16 * c), o[c]);
  }
  const __m512 w = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < chunks; ++c)
    _mm256_storeu_si256((__m256i*)(out + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[c], w)));
}

// G query rows (G <= 4) of one kv head at one query position, head dim 64: attend_row's arithmetic for each row, in
// the same order, with each key and value row loaded once for the G rows (the queries and the G weighted sums stay in
// registers). A row's result is bit for bit attend_row's: it does not depend on the rows beside it.
template <int G, typename E>
void attend_rows64(const float* const* q, const E* k, const E* v, int64_t stride, const int32_t* idx, int64_t n,
                   float scale, float* buf, uint16_t* const* out) {
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(q[g] + 16 * c);
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const E* kr = k + idx[i] * stride;
    const __m512 k0 = load16(kr), k1 = load16(kr + 16), k2 = load16(kr + 32), k3 = load16(kr + 48);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], k0);
      acc = _mm512_fmadd_ps(qv[g][1], k1, acc);
      acc = _mm512_fmadd_ps(qv[g][2], k2, acc);
      acc = _mm512_fmadd_ps(qv[g][3], k3, acc);
      const float s = _mm512_reduce_add_ps(acc) * scale;
      buf[g * n + i] = s;
      top[g] = s > top[g] ? s : top[g];
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = exp_in_place(buf + g * n, n, top[g]);
  __m512 o[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const E* vr = v + idx[i] * stride;
    const __m512 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(buf[g * n + i]);
      o[g][0] = _mm512_fmadd_ps(p, v0, o[g][0]);
      o[g][1] = _mm512_fmadd_ps(p, v1, o[g][1]);
      o[g][2] = _mm512_fmadd_ps(p, v2, o[g][2]);
      o[g][3] = _mm512_fmadd_ps(p, v3, o[g][3]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 w = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256((__m256i*)(out[g] + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[g][c], w)));
  }
}

}  // namespace

namespace {

// Where a call's queries, cache and output are: q float32 at q + b*qb + h*qh + t*qt; row b's cache (kv head g, slot s)
// at k + rows[b]*kb + g*kh + s*rs (rows null: row b); out at out + b*ob + h*oh + t*ot; allowed [B|1, T, S] or null.
struct Attention {
  const float* q;
  int64_t qb, qh, qt;
  const void* k;
  const void* v;
  int64_t kb, kh, rs;
  const int64_t* rows;
  uint16_t* out;
  int64_t ob, oh, ot;
  const bool* allowed;
  int64_t mb;  // rows of allowed (1: shared)
  int64_t B, H, T, D, KV, S;
  float scale;
};

template <typename E>
void attend_all(const Attention& a) {
  const int64_t B = a.B, H = a.H, T = a.T, D = a.D, S = a.S, G = H / a.KV;
  const bool grouped = D == 64 && G >= 2 && G <= 4;  // a query position's kv head as one piece of work
  const int64_t per = grouped ? G : 1, pieces = H / per;
  const E* kp = (const E*)a.k;
  const E* vp = (const E*)a.v;
  // pieces in the order (row, kv head, query position): a thread's pieces of one kv head come one after another, so
  // its keys and values come from memory once for all the positions (in the order (position, kv head) both threads
  // read every key of a layer: a second verified token cost 27 us a layer over 800 cached tokens, not 6)
  at::parallel_for(0, B * pieces * T, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> idx(T * S);  // row b's allowed slots per position t: idx[t * S ..), count[t] of them (-1: not listed)
    std::vector<int64_t> count(T, -1);
    std::vector<float> buf(4 * (S + 16));
    int64_t listed = -1;  // the row whose slots idx lists
    for (int64_t piece = r0; piece < r1; ++piece) {
      const int64_t b = piece / (pieces * T), h = (piece / T) % pieces * per, t = piece % T;
      if (b != listed) {
        std::fill(count.begin(), count.end(), (int64_t)-1);
        listed = b;
      }
      int32_t* slots = idx.data() + t * S;
      if (count[t] < 0) {
        const bool* m = a.allowed ? a.allowed + ((a.mb == 1 ? 0 : b) * T + t) * S : nullptr;
        int64_t c = 0;
        for (int64_t s = 0; s < S; ++s)
          if (!m || m[s]) slots[c++] = (int32_t)s;
        count[t] = c;
      }
      const int64_t n = count[t];
      const float* qs[4];
      uint16_t* os[4];
      for (int64_t g = 0; g < per; ++g) {
        qs[g] = a.q + b * a.qb + (h + g) * a.qh + t * a.qt;
        os[g] = a.out + b * a.ob + (h + g) * a.oh + t * a.ot;
      }
      if (n == 0) {  // a query that may see nothing (a padded row): zeros, not NaN
        for (int64_t g = 0; g < per; ++g) std::fill(os[g], os[g] + D, (uint16_t)0);
        continue;
      }
      const int64_t row = a.rows ? a.rows[b] : b;
      const E* kh0 = kp + row * a.kb + (h / G) * a.kh;
      const E* vh0 = vp + row * a.kb + (h / G) * a.kh;
      if (!grouped) {
        attend_row(qs[0], kh0, vh0, a.rs, slots, n, D, a.scale, buf.data(), os[0]);
      } else if (G == 2) {
        attend_rows64<2, E>(qs, kh0, vh0, a.rs, slots, n, a.scale, buf.data(), os);
      } else if (G == 3) {
        attend_rows64<3, E>(qs, kh0, vh0, a.rs, slots, n, a.scale, buf.data(), os);
      } else {
        attend_rows64<4, E>(qs, kh0, vh0, a.rs, slots, n, a.scale, buf.data(), os);
      }
    }
  });
}

void check_cache(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides(), "k, v: [B, KV, S, D], alike");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k, v: float32 or bfloat16");
  TORCH_CHECK(k.stride(3) == 1 && k.size(3) % 16 == 0 && k.size(3) <= 256, "k, v: D contiguous, a multiple of 16 up to 256");
}

const bool* allowed_of(const torch::Tensor& allowed, int64_t T, int64_t S) {
  if (allowed.numel() == 0) return nullptr;
  TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.is_contiguous() && allowed.dim() == 3 && allowed.size(1) == T &&
                  allowed.size(2) == S,
              "allowed [B|1, T, S]");
  return allowed.data_ptr<bool>();
}

void run_attention(const Attention& a, bool wide) {
  if (wide)
    attend_all<float>(a);
  else
    attend_all<uint16_t>(a);
}

// one head of D values rotated as fast_layers._rotate computes it in bfloat16: x * cos + roll(x, D / 2) * sin_signed,
// each product and the sum rounded to bfloat16 (torch's three operations); the result as float32 (exact)
inline void rotate_head(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t e = 0; e < D; ++e) {
    const float a = bf16_round(bf16_value(x[e]) * bf16_value(cos[e]));
    const float b = bf16_round(bf16_value(x[(e + half) % D]) * bf16_value(sin[e]));
    out[e] = bf16_round(a + b);
  }
}

template <typename E>
inline void store_row(E* dst, const float* src, int64_t D);
template <>
inline void store_row<float>(float* dst, const float* src, int64_t D) {
  std::memcpy(dst, src, D * sizeof(float));
}
template <>
inline void store_row<uint16_t>(uint16_t* dst, const float* src, int64_t D) {  // values already bfloat16: exact
  for (int64_t e = 0; e < D; ++e) dst[e] = c10::BFloat16(src[e]).x;
}

// the block's queries rotated into q (float32 [B, H, T, D]); its keys rotated and its values written at their slots
template <typename E>
void rotate_and_write(const uint16_t* qkv, int64_t ld, const uint16_t* cos, const uint16_t* sin, int64_t cb, E* k, E* v,
                      int64_t kb, int64_t kh, int64_t rs, const int64_t* rows, const int64_t* slots, int64_t B, int64_t T,
                      int64_t H, int64_t KV, int64_t D, float* q) {
  std::vector<float> row(D);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cache_row = rows ? rows[b] : b;
    for (int64_t t = 0; t < T; ++t) {
      const uint16_t* src = qkv + (b * T + t) * ld;
      const int64_t c = ((cb == 1 ? 0 : b) * T + t) * D;
      for (int64_t h = 0; h < H; ++h) rotate_head(src + h * D, cos + c, sin + c, D, q + ((b * H + h) * T + t) * D);
      const int64_t slot = slots[b * T + t];
      for (int64_t g = 0; g < KV; ++g) {
        rotate_head(src + (H + g) * D, cos + c, sin + c, D, row.data());
        store_row<E>(k + cache_row * kb + g * kh + slot * rs, row.data(), D);
        const uint16_t* vs = src + (H + KV + g) * D;
        for (int64_t e = 0; e < D; ++e) row[e] = bf16_value(vs[e]);
        store_row<E>(v + cache_row * kb + g * kh + slot * rs, row.data(), D);
      }
    }
  }
}

}  // namespace

// q [B, H, T, D] bfloat16; k, v [B, KV, S, D] float32 or bfloat16 (alike), D contiguous; allowed [B or 1, T, S] bool
// (or empty: every slot); out [B, H, T, D] bfloat16. Each query attends to its allowed slots in ascending order, and
// nothing else enters its arithmetic: its result does not depend on the other queries, on how many slots are masked,
// or where.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, torch::Tensor allowed) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16, "q: [B, H, T, D] bfloat16");
  check_cache(k, v);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % KV == 0, "shapes");
  auto qf = q.to(at::kFloat).contiguous();
  auto out = torch::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  Attention a{qf.data_ptr<float>(), H * T * D, T * D, D, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
              nullptr, (uint16_t*)out.data_ptr<at::BFloat16>(), H * T * D, T * D, D, allowed_of(allowed, T, S),
              allowed.numel() ? allowed.size(0) : 0, B, H, T, D, KV, S, (float)scale};
  run_attention(a, k.scalar_type() == at::kFloat);
  return out;
}

// One layer's attention from its fused projection: qkv [B*T, (H + 2 KV) D] bfloat16 (queries, keys, values); cos and
// sin_signed [B|1, T, D] bfloat16; the layer's cache k, v [rows, KV, slots, D]; the block's rows [B] (or empty: 0..B-1)
// and slots [B, T] int64. The keys and queries are rotated as fast_layers._rotate does, the keys and values written at
// their slots, then each query attends over slots [0, end) as `attend` does. Returns [B*T, H*D] bfloat16, the layout the
// output projection takes: the same bits as rotating, writing and attending by the separate calls.
torch::Tensor rope_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                          torch::Tensor rows, torch::Tensor slots, int64_t end, torch::Tensor allowed, double scale, int64_t H,
                          int64_t KV) {
  check_cache(k, v);
  const int64_t D = k.size(3), B = slots.size(0), T = slots.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.stride(1) == 1 && qkv.size(0) == B * T &&
                  qkv.size(1) == (H + 2 * KV) * D,
              "qkv: [B*T, (H + 2 KV) D] bfloat16");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(1) == T && cos.size(2) == D && (cos.size(0) == 1 || cos.size(0) == B),
              "cos, sin: [B|1, T, D] bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [B, T] int64");
  TORCH_CHECK(rows.numel() == 0 || (rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == B), "rows: [B] int64");
  TORCH_CHECK(H % KV == 0 && D % 2 == 0 && end <= k.size(2), "shapes");
  const int64_t* rp = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(2), "a slot outside the cache");
  for (int64_t b = 0; rp && b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < k.size(0), "a row outside the cache");
  if (!rp) TORCH_CHECK(B <= k.size(0), "more rows than the cache");
  auto qf = torch::empty({B, H, T, D}, qkv.options().dtype(at::kFloat));
  const bool wide = k.scalar_type() == at::kFloat;
  const uint16_t* xp = (const uint16_t*)qkv.data_ptr<at::BFloat16>();
  const uint16_t* cp = (const uint16_t*)cos.data_ptr<at::BFloat16>();
  const uint16_t* snp = (const uint16_t*)sin.data_ptr<at::BFloat16>();
  if (wide)
    rotate_and_write<float>(xp, qkv.stride(0), cp, snp, cos.size(0), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0),
                            k.stride(1), k.stride(2), rp, sp, B, T, H, KV, D, qf.data_ptr<float>());
  else
    rotate_and_write<uint16_t>(xp, qkv.stride(0), cp, snp, cos.size(0), (uint16_t*)k.data_ptr<at::BFloat16>(),
                               (uint16_t*)v.data_ptr<at::BFloat16>(), k.stride(0), k.stride(1), k.stride(2), rp, sp, B, T, H,
                               KV, D, qf.data_ptr<float>());
  auto out = torch::empty({B * T, H * D}, qkv.options());
  Attention a{qf.data_ptr<float>(), H * T * D, T * D, D, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
              rp, (uint16_t*)out.data_ptr<at::BFloat16>(), T * H * D, D, H * D, allowed_of(allowed, T, end),
              allowed.numel() ? allowed.size(0) : 0, B, H, T, D, KV, end, (float)scale};
  run_attention(a, wide);
  return out;
}

// ---- RMSNorm of bfloat16 rows, bit for bit torch's (kernels/cpu_int4.py: rms_norm) ---------------------------------
// F.rms_norm(x, (N,), None, eps) * w on a CPU: the squares summed in float32 in the order of torch's CPU reduction
// (8-lane vectors, four accumulators, a cascade of four levels, the vectors left over, the scalar tail, then the lanes
// one by one), divided by N, plus eps, 1 / sqrt; x times that rounded to bfloat16, times w rounded again.
// The file is built with -ffp-contract=off: no multiply and add here may become one fused operation.

namespace {

inline __m256 widen8(const uint16_t* p) {  // 8 bfloat16 -> float32, exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

float sum_squares(const uint16_t* x, int64_t n) {
  const int64_t vec = n / 8, size = vec / 4;
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < size) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / 4), step = int64_t(1) << power, mask = step - 1;
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc[4][4];
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = zero;
  auto square = [&](int64_t v) {
    const __m256 a = widen8(x + 8 * v);
    return _mm256_mul_ps(a, a);
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(i * 4 + k));
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero;
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(i * 4 + k));
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = size * 4; v < vec; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], square(v));
  __m256 p = acc[0][0];
  for (int k = 1; k < 4; ++k) p = _mm256_add_ps(p, acc[0][k]);
  float total = 0.0f;
  for (int64_t t = vec * 8; t < n; ++t) {
    const float a = bf16_value(x[t]);
    const float sq = a * a;
    total += sq;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, p);
  for (int l = 0; l < 8; ++l) total += lanes[l];
  return total;
}

// one row: out = bf16(bf16(x * r) * w), r = 1 / sqrt(sum(x^2) / n + eps)
void norm_row(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out) {
  const float var = sum_squares(x, n) / (float)n;
  const float r = 1.0f / std::sqrt(var + eps);
  const __m512 rv = _mm512_set1_ps(r);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 y = widen_bf16(x + c);
    const __m256i yb = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(y, rv));
    const __m512 yw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(yb), 16));
    _mm256_storeu_si256((__m256i*)(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(yw, widen_bf16(w + c))));
  }
  for (; c < n; ++c) {
    const float y = bf16_round(bf16_value(x[c]) * r);
    out[c] = c10::BFloat16(y * bf16_value(w[c])).x;
  }
}

}  // namespace

// x [M, N] bfloat16 (rows contiguous), w [N] bfloat16 -> [M, N]: F.rms_norm(x, (N,), None, eps) * w, bit for bit
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: [M, N] bfloat16, rows contiguous");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) == x.size(1), "w: [N] bfloat16");
  const int64_t M = x.size(0), N = x.size(1), stride = x.stride(0);
  auto out = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  const uint16_t* wp = (const uint16_t*)w.data_ptr<at::BFloat16>();
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m) norm_row(xp + m * stride, wp, N, (float)eps, op + m * N);
  return out;
}

// h, d [M, N] bfloat16 -> (h + d, F.rms_norm(h + d, (N,), None, eps) * w): a residual add and the next norm, bit for bit
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.sizes() == d.sizes() && h.scalar_type() == at::kBFloat16 && d.scalar_type() == at::kBFloat16, "h, d: [M, N] bfloat16");
  h = h.contiguous();
  d = d.contiguous();
  auto sum = torch::empty_like(h);
  const int64_t total = h.numel();
  const uint16_t* hp = (const uint16_t*)h.data_ptr<at::BFloat16>();
  const uint16_t* dp = (const uint16_t*)d.data_ptr<at::BFloat16>();
  uint16_t* sp = (uint16_t*)sum.data_ptr<at::BFloat16>();
  int64_t c = 0;
  for (; c + 16 <= total; c += 16)
    _mm256_storeu_si256((__m256i*)(sp + c), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen_bf16(hp + c), widen_bf16(dp + c))));
  for (; c < total; ++c) sp[c] = c10::BFloat16(bf16_value(hp[c]) + bf16_value(dp[c])).x;
  return {sum, rms_norm(sum, w, eps)};
}

// ---- one decoder layer in one call (kernels/cpu_int4.py: layer) ------------------------------------------------------
// fast_layers.layer_step with rope_attend, the norm kernels and int4_mm for its four linears ({packed, scale, zero}
// each), the SiLU and the residual sums by torch's own operations: the same operations in the same order, so the same
// bits, without a return to Python between them.
torch::Tensor layer(torch::Tensor hidden, torch::Tensor norm_in, double eps_in, torch::Tensor norm_post, double eps_post,
                    std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up,
                    std::vector<torch::Tensor> down, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                    torch::Tensor rows, torch::Tensor slots, int64_t end, torch::Tensor allowed, double scale, int64_t H,
                    int64_t KV) {
  TORCH_CHECK(qkv.size() == 3 && o.size() == 3 && gate_up.size() == 3 && down.size() == 3, "linears: {packed, scale, zero}");
  auto x = rms_norm(hidden, norm_in, eps_in);
  auto attended = rope_attend(int4_mm(x, qkv[0], qkv[1], qkv[2]), cos, sin, k, v, rows, slots, end, allowed, scale, H, KV);
  auto sum_norm = add_rms_norm(hidden, int4_mm(attended, o[0], o[1], o[2]), norm_post, eps_post);
  auto halves = int4_mm(sum_norm[1], gate_up[0], gate_up[1], gate_up[2]).chunk(2, -1);
  return sum_norm[0] + int4_mm(at::silu(halves[0]) * halves[1], down[0], down[1], down[2]);
}
