//! Heavy-tailed service times (`--service-tail`).
//!
//! An LLM's answer takes as long as the text it writes, and answer lengths are long-tailed: most
//! answers are short, a few are many times the median. `--service-time` then names the median,
//! and each admitted request draws its own time from a heavy-tailed distribution around it.
//!
//! # Why Pareto
//! A Pareto (power-law) tail is heavy in the strict sense: `P(X > x)` falls as `x^-alpha`, so
//! one parameter says how heavy (below 2 the variance is infinite; below 1 the mean too), and
//! doubling a time divides its chance by the same factor anywhere in the tail. A lognormal's
//! tail is long but thinner (every moment is finite) and needs a normal sampler. Pareto is also
//! drawn by inverting its CDF from one uniform number, so a seeded run stays reproducible.
//!
//! # The draw
//! With scale `x_m` and shape `alpha`, `X = x_m / U^(1/alpha)` for `U` uniform in `(0, 1]`; its
//! median is `x_m * 2^(1/alpha)`, so `x_m = median / 2^(1/alpha)`. Draws are capped at
//! [`CAP`] times the median so that one run stays bounded in time.

use std::time::Duration;

/// Largest draw, in medians: keeps a run bounded however heavy the tail.
pub const CAP: f64 = 20.0;

/// The distribution of service times around the `--service-time` median.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServiceTail {
    /// Pareto with shape `alpha` (> 0): smaller is heavier.
    Pareto { alpha: f64 },
}

impl ServiceTail {
    /// The service time for a uniform draw `u` in `[0, 1)`, around `median`, capped at
    /// 20 medians. The same `u` always gives the same time.
    pub fn draw(self, median: Duration, u: f64) -> Duration {
        match self {
            ServiceTail::Pareto { alpha } => {
                // `1 - u` is in (0, 1]: never a division by zero.
                let scale = 2f64.powf(-1.0 / alpha);
                let medians = scale / (1.0 - u).powf(1.0 / alpha);
                median.mul_f64(medians.min(CAP))
            }
        }
    }
}

/// clap value parser for `pareto:ALPHA`.
pub fn parse_service_tail(s: &str) -> Result<ServiceTail, String> {
    let (kind, alpha) = s
        .split_once(':')
        .ok_or_else(|| format!("expected pareto:ALPHA (e.g. `pareto:1.5`), got `{s}`"))?;
    if kind.trim() != "pareto" {
        return Err(format!(
            "unknown distribution `{kind}`: only `pareto:ALPHA` is offered"
        ));
    }
    let alpha: f64 = alpha
        .trim()
        .parse()
        .map_err(|e| format!("ALPHA `{alpha}`: {e}"))?;
    Ok(ServiceTail::Pareto { alpha })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEDIAN: Duration = Duration::from_millis(200);

    fn pareto(alpha: f64) -> ServiceTail {
        ServiceTail::Pareto { alpha }
    }

    #[test]
    fn the_middle_draw_is_the_median() {
        for alpha in [0.5, 1.0, 1.5, 3.0] {
            let d = pareto(alpha).draw(MEDIAN, 0.5);
            assert!(
                d.abs_diff(MEDIAN) < Duration::from_micros(1),
                "{alpha}: {d:?}"
            );
        }
    }

    #[test]
    fn draws_follow_the_power_law_until_the_cap() {
        // alpha 1.5: P(X > x) = (x_m / x)^1.5, so the 99th percentile is x_m * 100^(1/1.5).
        let p99 = pareto(1.5).draw(MEDIAN, 0.99).as_secs_f64();
        let x_m = 0.2 / 2f64.powf(1.0 / 1.5);
        assert!((p99 - x_m * 100f64.powf(1.0 / 1.5)).abs() < 1e-6, "{p99}");
        // The far tail is cut at 20 medians, and the smallest draw is x_m.
        assert_eq!(pareto(1.5).draw(MEDIAN, 0.999_999), MEDIAN * 20);
        let least = pareto(1.5).draw(MEDIAN, 0.0).as_secs_f64();
        assert!((least - x_m).abs() < 1e-9, "{least}");
    }

    #[test]
    fn a_smaller_alpha_is_a_heavier_tail() {
        let heavy = pareto(1.1).draw(MEDIAN, 0.9);
        let light = pareto(3.0).draw(MEDIAN, 0.9);
        assert!(heavy > light, "{heavy:?} vs {light:?}");
    }

    #[test]
    fn parser_reads_pareto_and_names_the_format() {
        assert_eq!(parse_service_tail("pareto:1.5"), Ok(pareto(1.5)));
        let err = parse_service_tail("lognormal:1").unwrap_err();
        assert!(err.contains("pareto:ALPHA"), "{err}");
        let err = parse_service_tail("pareto").unwrap_err();
        assert!(err.contains("pareto:ALPHA"), "{err}");
        assert!(parse_service_tail("pareto:heavy").is_err());
    }
}
