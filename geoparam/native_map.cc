// The theta -> u map of geoparam.hyperspherical and its VJP as two XLA FFI CPU kernels
// (float32). geoparam.native compiles this file on first use; see its docstring.
//
// theta has shape (R, F) (R = n - 1 angles, F = every trailing axis flattened), u (R + 1, F):
//   u_k = P_{k-1} cos(t_k) (k < R), u_R = P_{R-1},  P_k = sin(t_0) ... sin(t_k).
// The VJP, division-free, with R_k = g_{k+1} c_{k+1} + s_{k+1} R_{k+1}, R_{R-1} = g_R:
//   dL/dt_k = P_{k-1} (c_k R_k - s_k g_k).
// sin/cos of a row come from the same Cody-Waite reduction and polynomials as
// hyperspherical._sincos_poly when every |t| in the row is within its bound, else from
// std::sin/std::cos (NaN and inf take that path too). The numbers of that reduction and those
// polynomials come from hyperspherical.py, passed by native.py as -D flags. Built with
// -ffp-contract=off: no FMA contraction, so the result does not depend on the instruction set
// the compiler targets.
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kTwoOverPi = GEOPARAM_TWO_OVER_PI;
constexpr float kPio2Parts[] = GEOPARAM_PIO2_PARTS;  // pi/2 = the sum of the parts
constexpr float kSin[] = GEOPARAM_SIN_COEFFS;
constexpr float kCos[] = GEOPARAM_COS_COEFFS;
constexpr float kBound = GEOPARAM_SINCOS_BOUND;
static_assert(sizeof(kSin) == 3 * sizeof(float) && sizeof(kCos) == 3 * sizeof(float),
              "the polynomials below have three coefficients each");

inline void SinCosPoly(float x, float* s, float* c) {
  const float k = std::nearbyint(x * kTwoOverPi);  // x = k pi/2 + r
  float r = x;
  for (float part : kPio2Parts) r = r - k * part;
  const float z = r * r;
  const float sin_r = r + r * z * (kSin[0] + z * (kSin[1] + z * kSin[2]));
  const float cos_r = 1.0f - 0.5f * z + z * z * (kCos[0] + z * (kCos[1] + z * kCos[2]));
  const int q = static_cast<int>(k);
  float sin_x = (q & 1) ? cos_r : sin_r;
  const float cos_x = (q & 1) ? sin_r : cos_r;
  if (q & 2) sin_x = -sin_x;
  *s = (x == 0.0f) ? x : sin_x;  // sin(-0) = -0
  *c = ((q + 1) & 2) ? -cos_x : cos_x;
}

// sin and cos of one row of F angles.
void SinCosRow(const float* t, float* s, float* c, int64_t F) {
  bool in_range = true;
  for (int64_t j = 0; j < F; ++j) in_range &= std::fabs(t[j]) <= kBound;  // false for NaN
  if (in_range) {
    for (int64_t j = 0; j < F; ++j) SinCosPoly(t[j], s + j, c + j);
  } else {
    for (int64_t j = 0; j < F; ++j) {
      s[j] = std::sin(t[j]);
      c[j] = std::cos(t[j]);
    }
  }
}

// (R, F) of an array whose axis 0 holds the angles.
void RowsAndWidth(ffi::Span<const int64_t> dims, int64_t* R, int64_t* F) {
  *R = dims.size() ? dims[0] : 1;
  *F = 1;
  for (size_t i = 1; i < dims.size(); ++i) *F *= dims[i];
}

ffi::Error Forward(ffi::Buffer<ffi::F32> theta, ffi::ResultBuffer<ffi::F32> u) {
  int64_t R, F;
  RowsAndWidth(theta.dimensions(), &R, &F);
  const float* t = theta.typed_data();
  float* out = u->typed_data();
  std::vector<float> p(F, 1.0f), s(F), c(F);
  for (int64_t k = 0; k < R; ++k) {
    SinCosRow(t + k * F, s.data(), c.data(), F);
    float* u_k = out + k * F;
    for (int64_t j = 0; j < F; ++j) {
      u_k[j] = p[j] * c[j];
      p[j] *= s[j];
    }
  }
  for (int64_t j = 0; j < F; ++j) out[R * F + j] = p[j];
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> theta, ffi::Buffer<ffi::F32> g,
                    ffi::ResultBuffer<ffi::F32> d_theta) {
  int64_t R, F;
  RowsAndWidth(theta.dimensions(), &R, &F);
  const float* t = theta.typed_data();
  const float* g_all = g.typed_data();
  float* d = d_theta->typed_data();
  std::vector<float> p(F, 1.0f), s(F), c(F), r(g_all + R * F, g_all + (R + 1) * F);
  for (int64_t k = 0; k < R; ++k) {  // d_k = P_{k-1} first
    SinCosRow(t + k * F, s.data(), c.data(), F);
    float* d_k = d + k * F;
    for (int64_t j = 0; j < F; ++j) {
      d_k[j] = p[j];
      p[j] *= s[j];
    }
  }
  for (int64_t k = R - 1; k >= 0; --k) {
    SinCosRow(t + k * F, s.data(), c.data(), F);
    float* d_k = d + k * F;
    const float* g_k = g_all + k * F;
    for (int64_t j = 0; j < F; ++j) {
      d_k[j] *= c[j] * r[j] - s[j] * g_k[j];
      r[j] = g_k[j] * c[j] + s[j] * r[j];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GeoparamMapForward, Forward,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GeoparamMapBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
