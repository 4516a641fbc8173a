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
#include <torch/extension.h>

namespace {

constexpr int64_t kGroup = 32, kBlockN = 16, kRowsMax = 8;

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

// one query row: q [D] float, the keys/values of its kv head at the slots idx[0..n) (ascending), out [D] bfloat16
void attend_row(const float* q, const float* k, const float* v, int64_t stride, const int32_t* idx, int64_t n, int64_t D,
                float scale, float* buf, uint16_t* out) {
  const int64_t chunks = D / 16;
  __m512 qv[16];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float* kr = k + idx[i] * stride;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
    for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
    const float s = _mm512_reduce_add_ps(acc) * scale;
    buf[i] = s;
    top = s > top ? s : top;
  }
  const float inv = exp_in_place(buf, n, top);
  __m512 o[16];
  for (int64_t c = 0; c < chunks; ++c) o[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m512 p = _mm512_set1_ps(buf[i]);
    const float* vr = v + idx[i] * stride;
    for (int64_t c = 0; c < chunks; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), o[c]);
  }
  const __m512 w = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < chunks; ++c)
    _mm256_storeu_si256((__m256i*)(out + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[c], w)));
}

// G query rows (G <= 4) of one kv head at one query position, head dim 64: attend_row's arithmetic for each row, in
// the same order, with each key and value row loaded once for the G rows (the queries and the G weighted sums stay in
// registers). A row's result is bit for bit attend_row's: it does not depend on the rows beside it.
template <int G>
void attend_rows64(const float* const* q, const float* k, const float* v, int64_t stride, const int32_t* idx, int64_t n,
                   float scale, float* buf, uint16_t* const* out) {
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(q[g] + 16 * c);
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float* kr = k + idx[i] * stride;
    const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16), k2 = _mm512_loadu_ps(kr + 32), k3 = _mm512_loadu_ps(kr + 48);
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
    const float* vr = v + idx[i] * stride;
    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
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

// q [B, H, T, D] bfloat16; k, v [B, KV, S, D] float32 with D contiguous; allowed [B or 1, T, S] bool (or empty: every
// slot); out [B, H, T, D] bfloat16. Each query attends to its allowed slots in ascending order, and nothing else
// enters its arithmetic: its result does not depend on the other queries, on how many slots are masked, or where.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, torch::Tensor allowed) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16, "q: [B, H, T, D] bfloat16");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.sizes() == v.sizes(), "k, v: float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), S = k.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && H % KV == 0 && k.size(3) == D && k.size(0) == B, "shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(), "k, v: D contiguous, alike");
  const bool masked = allowed.numel() > 0;
  if (masked) TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.is_contiguous() && allowed.size(1) == T && allowed.size(2) == S, "allowed [B|1, T, S]");
  auto qf = q.to(at::kFloat).contiguous();
  auto out = torch::empty({B, H, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = qf.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* ap = masked ? allowed.data_ptr<bool>() : nullptr;
  const int64_t mb = masked ? allowed.size(0) : 0;
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  const int64_t G = H / KV;
  const int64_t kb = k.stride(0), kh = k.stride(1), vb = v.stride(0), vh = v.stride(1), rs = k.stride(2);
  TORCH_CHECK(v.stride(2) == rs, "k, v: one slot stride");
  const bool grouped = D == 64 && G >= 2 && G <= 4;  // a query position's kv head as one piece of work
  const int64_t per = grouped ? G : 1;
  at::parallel_for(0, B * T * H / per, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> idx(S);
    std::vector<float> buf(4 * (S + 16));
    int64_t listed = -1, n = 0;  // the (b, t) whose slots idx lists
    for (int64_t piece = r0; piece < r1; ++piece) {
      const int64_t r = piece * per;  // its first row
      const int64_t bt = r / H, h = r % H, b = bt / T, t = bt % T;
      if (bt != listed) {
        const bool* a = masked ? ap + ((mb == 1 ? 0 : b) * T + t) * S : nullptr;
        n = 0;
        for (int64_t s = 0; s < S; ++s)
          if (!masked || a[s]) idx[n++] = (int32_t)s;
        listed = bt;
      }
      const float* qs[4];
      uint16_t* os[4];
      for (int64_t g = 0; g < per; ++g) {
        qs[g] = qp + ((b * H + h + g) * T + t) * D;
        os[g] = op + ((b * H + h + g) * T + t) * D;
      }
      if (n == 0) {  // a query that may see nothing (a padded row): zeros, not NaN
        for (int64_t g = 0; g < per; ++g) std::fill(os[g], os[g] + D, (uint16_t)0);
        continue;
      }
      const float* kh0 = kp + b * kb + (h / G) * kh;
      const float* vh0 = vp + b * vb + (h / G) * vh;
      if (!grouped) {
        attend_row(qs[0], kh0, vh0, rs, idx.data(), n, D, (float)scale, buf.data(), os[0]);
      } else if (G == 2) {
        attend_rows64<2>(qs, kh0, vh0, rs, idx.data(), n, (float)scale, buf.data(), os);
      } else if (G == 3) {
        attend_rows64<3>(qs, kh0, vh0, rs, idx.data(), n, (float)scale, buf.data(), os);
      } else {
        attend_rows64<4>(qs, kh0, vh0, rs, idx.data(), n, (float)scale, buf.data(), os);
      }
    }
  });
  return out;
}
